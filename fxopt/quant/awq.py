"""AWQ (Lin et al., 2023): activation-aware per-input-channel scaling, a clip search, then rounding.

For the linears that read one input ``x``, input channel c of every weight is multiplied by ``s_c`` and ``x[..., c]``
divided by it (folded into the producer of ``x``: a norm, :func:`find_norm_fold`, or a preceding linear), so salient
channels use more of the int4 grid. ``s`` is searched over two families on the output error, measured exactly
through the Gram matrix ``H = XᵀX / n`` (``tr(Δ H Δᵀ)``); α = 0 is round-to-nearest, so the search never does worse
than RTN on that objective. The clip search then shrinks each group's range (per row and group, least error).
See docs/architecture.md, "Quantization".
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from .gptq import fake_quantize

log = logging.getLogger(__name__)


@dataclass
class ScaleSearch:
    """Result of :func:`search_scale`: the scale per input channel of the linears, per source channel, and α."""

    scale: torch.Tensor
    source_scale: torch.Tensor
    ratio: float
    errors: list = field(default_factory=list)


@torch.no_grad()
def search_scale(weights: list[torch.Tensor], H: torch.Tensor, x_absmean: torch.Tensor, group_size: int,
                 sym: bool = False, n_grid: int = 20, scale_dtype: torch.dtype = torch.float16,
                 channel_map: Optional[torch.Tensor] = None) -> ScaleSearch:
    """Pick ``s = mean|x|^α`` or ``mean|x|^α / mean|ŵ|^(1-α)`` minimising the summed output error of ``weights``
    (each [N_i, K]) after int4 RTN; the first ``n_grid`` entries of ``errors`` are the plain family (α = 0 is RTN).
    ``channel_map`` (int64 [K]) ties input channels that one producer channel feeds (GQA): ``s[j] = s_src[map[j]]``.
    """
    W = torch.cat([w.detach().float() for w in weights], dim=0).to(H.device)
    K = W.shape[1]
    H = H.float()
    xm = x_absmean.float().to(H.device)
    if channel_map is not None:
        channel_map = channel_map.to(H.device)
        n_src = int(channel_map.max()) + 1
        src = torch.zeros(n_src, device=H.device).index_add_(0, channel_map, xm)
        cnt = torch.zeros(n_src, device=H.device).index_add_(0, channel_map, torch.ones_like(xm))
        src_mean = src / cnt.clamp(min=1)
    else:
        src_mean = xm
    candidates = [(i / n_grid, src_mean.pow(i / n_grid)) for i in range(n_grid)]
    # mean over output rows of |w| relative to its group's max |w|, per input (source) channel
    G = K if group_size == -1 else group_size
    Wa = W.abs().reshape(W.shape[0], K // G, G)
    wm = (Wa / (Wa.amax(-1, keepdim=True) + 1e-6)).reshape(W.shape[0], K).mean(0)
    if channel_map is not None:
        wm = torch.zeros(n_src, device=H.device).index_add_(0, channel_map, wm) / cnt.clamp(min=1)
    candidates += [(i / n_grid, src_mean.pow(i / n_grid) / (wm.pow(1 - i / n_grid) + 1e-4)) for i in range(n_grid)]
    best_err, best_ratio, best_src = math.inf, 0.0, torch.ones_like(src_mean)
    errors = []
    for ratio, s_src in candidates:
        s_src = s_src.clamp(min=1e-4)
        s_src = s_src / (s_src.max() * s_src.min()).sqrt()
        s = s_src[channel_map] if channel_map is not None else s_src
        deq = fake_quantize(W * s, group_size, sym, scale_dtype)[0] / s
        D = deq - W
        err = float(((D @ H) * D).sum())
        errors.append(err)
        if err < best_err:
            best_err, best_ratio, best_src = err, ratio, s_src
    s = best_src[channel_map] if channel_map is not None else best_src
    if not math.isfinite(best_err):
        raise ValueError("AWQ scale search produced a non-finite error (inf/nan in activations or weights)")
    assert s.shape[0] == K
    return ScaleSearch(s, best_src, best_ratio, errors)


@torch.no_grad()
def search_clip(weight: torch.Tensor, H: torch.Tensor, group_size: int, sym: bool = False, n_grid: int = 20,
                max_shrink: float = 0.5, scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Clip each (row, group) of ``weight`` [N, K] to the range with the least output error among
    ``±max|w| · (1 - i/n_grid)`` and (asymmetric grids) ``[min w · (1 - i/n_grid), max w · (1 - j/n_grid)]``."""
    W = weight.detach().float().to(H.device)
    N, K = W.shape
    G = K if group_size == -1 else group_size
    ng = K // G
    Wg = W.reshape(N, ng, G)
    Hb = torch.stack([H[g * G:(g + 1) * G, g * G:(g + 1) * G] for g in range(ng)]).float()  # [ng, G, G]
    org_max = Wg.abs().amax(-1, keepdim=True)
    org_lo, org_hi = Wg.amin(-1, keepdim=True).clamp(max=0), Wg.amax(-1, keepdim=True).clamp(min=0)
    best_err = torch.full((N, ng), math.inf, device=W.device)
    best_lo, best_hi = -org_max, org_max.clone()
    steps = max(1, int(max_shrink * n_grid))
    # clip ranges: ±max|w| shrunk (the paper's), and (asymmetric grids) [min w · a, max w · b] with both ends shrunk
    # independently, which an asymmetric grid can use; a = b = 1 is no clipping
    shrink = [1 - i / n_grid for i in range(steps)]
    ranges = [(-org_max * a, org_max * a) for a in shrink]
    if not sym:
        ranges += [(org_lo * a, org_hi * b) for a in shrink for b in shrink]
    for lo, hi in ranges:
        cur = torch.maximum(torch.minimum(Wg, hi), lo)
        deq = fake_quantize(cur.reshape(N, K), G, sym, scale_dtype)[0].reshape(N, ng, G)
        D = deq - Wg
        err = torch.einsum("ngi,gij,ngj->ng", D, Hb, D)
        better = (err < best_err)[..., None]
        best_err = torch.where(better[..., 0], err, best_err)
        best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
    return torch.maximum(torch.minimum(Wg, best_hi), best_lo).reshape(N, K)


_PASSTHROUGH = {"to", "float", "half", "bfloat16", "type_as", "contiguous"}


def _name(node) -> Optional[str]:
    from ..passes.match import op_name

    name = op_name(node)
    if name is None and isinstance(node, fx.Node) and node.op == "call_function":
        name = getattr(node.target, "__name__", None)
    return name


@dataclass
class NormFold:
    """Parameters of a norm that multiply its output per channel: ``(param, offset)`` means the multiplier is
    ``param + offset`` (Gemma's ``1 + weight``); ``biases`` are added after the multiplication."""

    multipliers: list
    biases: list
    description: str

    @torch.no_grad()
    def apply(self, s: torch.Tensor, touch: Callable[[torch.Tensor], None]) -> None:
        """Make the norm output ``x / s`` (``touch(p)`` is called before each parameter changes)."""
        for p, offset in self.multipliers:
            touch(p)
            p.copy_(((p.float() + offset) / s.to(p.device) - offset).to(p.dtype))
        for b in self.biases:
            touch(b)
            b.copy_((b.float() / s.to(b.device)).to(b.dtype))


def _through_passthrough(node: fx.Node) -> fx.Node:
    while isinstance(node, fx.Node) and _name(node) in _PASSTHROUGH and len(node.users) == 1:
        node = node.args[0]
    return node


def _param_multiplier(node, params: dict, K: int):
    """``node`` computes ``p`` or ``p + c`` / ``c + p`` (through dtype casts), p a 1-D parameter of size K used only
    there: return (p, c), else None."""
    p = _channel_param(node, params, K)
    if p is not None:
        return p, 0.0
    node = _through_passthrough(node)
    if _name(node) == "add" and len(node.users) == 1 and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        for pn, c in ((a, b), (b, a)):
            if isinstance(c, (int, float)) and isinstance(pn, fx.Node):
                inner = _param_multiplier(pn, params, K)
                if inner is not None and inner[1] == 0.0:
                    return inner[0], float(c)
    return None


def _channel_param(node, params: dict, K: int):
    """The 1-D parameter of size K that ``node`` is (through dtype casts), used only there, or None."""
    node = _through_passthrough(node)
    if isinstance(node, fx.Node) and node in params and len(node.users) == 1:
        p = params[node]
        if p.dim() == 1 and p.numel() == K:
            return p
    return None


def find_norm_fold(x: fx.Node, params: dict, K: int) -> Optional[NormFold]:
    """How to fold a scale into the norm producing ``x`` (``... * weight (+ bias)`` with parameters used only
    there, or ``layer_norm`` / ``rms_norm`` with a parameter weight; only single-user casts in between), or None.
    ``params`` maps placeholder / get_attr nodes to parameters."""
    node = x
    # casts between the multiplication and x (x itself may have several users: the linears)
    while _name(node) in _PASSTHROUGH and isinstance(node.args[0], fx.Node) and len(node.args[0].users) == 1:
        node = node.args[0]
    name = _name(node)
    if name in ("layer_norm", "rms_norm"):
        w = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        b = node.args[3] if len(node.args) > 3 and name == "layer_norm" else node.kwargs.get("bias")
        wp = _channel_param(w, params, K) if isinstance(w, fx.Node) else None
        if wp is None:
            return None
        biases = []
        if isinstance(b, fx.Node):
            bp = _channel_param(b, params, K)
            if bp is None:
                return None
            biases.append(bp)
        return NormFold([(wp, 0.0)], biases, f"{name} weight")
    biases = []
    if name == "add" and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        for bias_node, rest in ((a, b), (b, a)):
            bp = _channel_param(bias_node, params, K) if isinstance(bias_node, fx.Node) else None
            if bp is not None and isinstance(rest, fx.Node) and len(rest.users) == 1:
                biases.append(bp)
                node = _through_passthrough(rest)
                name = _name(node)
                break
        else:
            return None
    if name == "mul" and len(node.args) == 2 and not node.kwargs:
        for cand in node.args:
            m = _param_multiplier(cand, params, K)
            if m is not None:
                return NormFold([m], biases, "norm weight" + (" (1 + w)" if m[1] else ""))
    return None
