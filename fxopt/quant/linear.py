"""``QuantLinear``: an ``nn.Linear`` stand-in that holds only fxopt's packed int4 weight.

Design
------
The module stores the packed weight (``qweight``, ``scales``, ``zeros``, optional act-order ``perm``; see
:mod:`fxopt.quant.format`) and an optional bias, all as buffers, and computes::

    x = x.index_select(-1, perm)                       # act-order only: one gather of the activations
    y = F.linear(x, torch.ops.fxopt.dequantize_w4(qweight, scales, zeros, group_size), bias)

So eagerly (CPU or GPU, no compile) the model is correct: the weight is dequantized, then a plain linear runs. In the
Dynamo graph the same code reads ``dequantize_w4 -> linear``, which the ``w4a16`` pass (:mod:`fxopt.passes.w4a16`)
fuses into ``torch.ops.fxopt.w4a16_linear``: the 16-bit weight is then never written to memory.

When the activation dtype differs from the scales dtype (e.g. an fp32 model with fp16 scales), the weight is
dequantized in fp32 and cast to the activation dtype (as is the bias); the pass leaves such linears alone (with a
reason), since the fused kernel needs fp16/bf16 activations matching the scales.

Act-order permutations are canonicalized by :meth:`QuantLinear.from_packed`: within each group (a contiguous run of
``group_size`` stored rows) the rows are ordered by increasing input feature. That is the order a checkpoint's
``g_idx`` describes (groups are sets of input features, the order inside a group is not stored), so
``load_quantized(save_quantized(m))`` reproduces ``m`` bit for bit; a permutation that turns out to be the identity
is dropped (``perm = None``, the fast path).

:func:`replace_linears` swaps ``nn.Linear`` modules for replacements (used by RTN here and by GPTQ / AWQ).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import w4a16 as _w4a16_ops  # noqa: F401  registers torch.ops.fxopt.dequantize_w4 / w4a16_linear
from .format import PACK, PackedW4, pack_int4, quantize_rtn, unpack_int4

log = logging.getLogger(__name__)

__all__ = ["QuantLinear", "replace_linears", "canonical_perm"]


def canonical_perm(qweight: torch.Tensor, perm: Optional[torch.Tensor], group_size: int):
    """Return ``(qweight, perm)`` with the rows of every group sorted by input feature; ``perm=None`` if identity.

    Raises ValueError if ``perm`` is not a permutation of ``range(K)``.
    """
    if perm is None:
        return qweight, None
    K = qweight.shape[0] * PACK
    perm = perm.to(torch.int64)
    if perm.dim() != 1 or perm.numel() != K:
        raise ValueError(f"perm must be [{K}], got {tuple(perm.shape)}")
    seen = torch.zeros(K, dtype=torch.bool, device=perm.device)
    if int(perm.min()) < 0 or int(perm.max()) >= K or seen.index_fill_(0, perm, True).sum() != K:
        raise ValueError(f"perm is not a permutation of range({K})")
    # Sort each group's members; `order` maps new stored row -> old stored row.
    grouped = perm.view(K // group_size, group_size)
    sorted_vals, idx = grouped.sort(dim=1, stable=True)
    order = (idx + torch.arange(0, K, group_size, device=perm.device).unsqueeze(1)).reshape(-1)
    new_perm = sorted_vals.reshape(-1)
    if torch.equal(new_perm, torch.arange(K, device=perm.device)):
        new_perm = None
    if torch.equal(order, torch.arange(K, device=perm.device)):
        return qweight, new_perm
    codes = unpack_int4(qweight)
    return pack_int4(codes.index_select(0, order.to(codes.device))), new_perm


class QuantLinear(nn.Module):
    """A linear layer with an int4 weight in fxopt's packed format (W4A16).

    Args:
        in_features: K.
        out_features: N.
        group_size: G (K % G == 0; ``-1`` means K).
        bias: whether the layer has a bias.
        dtype: dtype of scales / zeros / bias (fp16 or bf16; fp32 is accepted for reference use).
        device: where the (zero-initialized) buffers live.

    Buffers: ``qweight`` int32 [K/8, N], ``scales`` / ``zeros`` [K/G, N], ``perm`` int64 [K] or None, ``bias`` [N] or
    None. Build one with :meth:`from_packed` or :meth:`from_linear`.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int = 128, bias: bool = False,
                 dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        if in_features % PACK:
            raise ValueError(f"QuantLinear: in_features {in_features} must be a multiple of {PACK}")
        G = in_features if group_size == -1 else group_size
        if G <= 0 or in_features % G:
            raise ValueError(f"QuantLinear: group size {group_size} does not divide in_features {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = G
        ng = in_features // G
        self.register_buffer("qweight", torch.zeros(in_features // PACK, out_features, dtype=torch.int32,
                                                    device=device))
        self.register_buffer("scales", torch.ones(ng, out_features, dtype=dtype, device=device))
        self.register_buffer("zeros", torch.full((ng, out_features), 8, dtype=dtype, device=device))
        self.register_buffer("perm", None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_packed(cls, packed: PackedW4, bias: Optional[torch.Tensor] = None) -> "QuantLinear":
        """Wrap a :class:`PackedW4` (tensors are used as they are, on their device; bias cast to the scales dtype).

        An act-order ``perm`` is canonicalized (see the module docstring); the identity becomes ``None``.
        """
        qweight, perm = canonical_perm(packed.qweight, packed.perm, packed.group_size)
        K, N = packed.in_features, packed.out_features
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
            raise ValueError(f"QuantLinear: bias must be [{N}], got {tuple(bias.shape)}")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features, m.group_size = K, N, packed.group_size
        dev = packed.qweight.device
        m.register_buffer("qweight", qweight.contiguous())
        m.register_buffer("scales", packed.scales.contiguous())
        m.register_buffer("zeros", packed.zeros.contiguous())
        m.register_buffer("perm", None if perm is None else perm.to(device=dev, dtype=torch.int64).contiguous())
        m.register_buffer("bias", None if bias is None else
                          bias.detach().to(device=dev, dtype=packed.scales.dtype).contiguous())
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, sym: bool = False,
                    dtype: Optional[torch.dtype] = None) -> "QuantLinear":
        """Round-to-nearest quantization of an ``nn.Linear`` (:func:`fxopt.quant.format.quantize_rtn`).

        ``dtype`` of scales / zeros / bias: default the weight's dtype if fp16/bf16, else fp16.
        """
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"QuantLinear.from_linear needs an nn.Linear, got {type(linear).__name__}")
        with torch.no_grad():
            packed = quantize_rtn(linear.weight.detach(), group_size=group_size, sym=sym, dtype=dtype)
        return cls.from_packed(packed, linear.bias)

    def packed(self) -> PackedW4:
        """The weight as a :class:`PackedW4` (the module's own tensors, not copies)."""
        return PackedW4(self.qweight, self.scales, self.zeros, self.group_size, self.perm)

    def dequantized_weight(self) -> torch.Tensor:
        """W [N, K] in the original input-feature order (un-permuted), in the scales dtype."""
        w = torch.ops.fxopt.dequantize_w4(self.qweight, self.scales, self.zeros, self.group_size)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if x.dtype == self.scales.dtype:
            w = torch.ops.fxopt.dequantize_w4(self.qweight, self.scales, self.zeros, self.group_size)
            return F.linear(x, w, self.bias)
        # e.g. fp32 activations with fp16 scales: dequantize in fp32, then cast (correct, but not fused by the pass)
        w = torch.ops.fxopt.dequantize_w4(self.qweight, self.scales.float(), self.zeros.float(), self.group_size)
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, act_order={self.perm is not None}, dtype={self.scales.dtype}")


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def replace_linears(model: nn.Module,
                    fn_or_names: Union[Callable[[str, nn.Linear], Optional[nn.Module]], Mapping[str, nn.Module],
                                       Iterable[str]],
                    **rtn_kwargs) -> list[str]:
    """Replace ``nn.Linear`` submodules of ``model`` in place; return the replaced names (in module order).

    ``fn_or_names`` is one of:

    * a callable ``fn(name, linear) -> module or None``, called on every ``nn.Linear`` (``None`` keeps it);
    * a mapping ``{name: replacement_module}``;
    * an iterable of names: each is replaced by ``QuantLinear.from_linear(linear, **rtn_kwargs)`` (RTN).

    Names given explicitly must exist and be ``nn.Linear``: otherwise a ValueError is raised before anything is
    replaced. Replacements are computed first and installed at the end, so a failing ``fn`` leaves the model as it was.
    """
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if callable(fn_or_names) and not isinstance(fn_or_names, Mapping):
        if rtn_kwargs:
            raise ValueError(f"replace_linears: keyword arguments {sorted(rtn_kwargs)} only apply to a list of names")
        new = {}
        for n, m in linears.items():
            r = fn_or_names(n, m)
            if r is not None:
                new[n] = r
    else:
        if isinstance(fn_or_names, str):
            raise ValueError("replace_linears: pass a list of module names, not a single string")
        items = fn_or_names.items() if isinstance(fn_or_names, Mapping) else [(n, None) for n in fn_or_names]
        items = list(items)
        bad = [n for n, _ in items if n not in linears]
        if bad:
            raise ValueError(f"replace_linears: not nn.Linear modules of the model: {bad}")
        if isinstance(fn_or_names, Mapping):
            if rtn_kwargs:
                raise ValueError("replace_linears: keyword arguments only apply to a list of names")
            new = dict(items)
        else:
            new = {n: QuantLinear.from_linear(linears[n], **rtn_kwargs) for n, _ in items}
    for n, r in new.items():
        if not isinstance(r, nn.Module):
            raise ValueError(f"replace_linears: replacement for {n!r} is {type(r).__name__}, not an nn.Module")
    for n in new:
        _set_submodule(model, n, new[n])
    log.debug("replace_linears: replaced %d linear(s)", len(new))
    return list(new)


# Linears that read the same input in the models fxopt is measured on (attention's q/k/v, the gated MLP's gate/up).
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"),
                 ("w1", "w3"))


def _side_by_side(parts: list) -> list:
    """One new tensor holding ``parts`` side by side along their last dim; return its slices (views), in order."""
    base = torch.cat(parts, dim=-1)
    out, col = [], 0
    for p in parts:
        out.append(base.narrow(-1, col, p.shape[-1]))
        col += p.shape[-1]
    return out


def share_sibling_storage(model: nn.Module, names=SIBLING_NAMES) -> list[tuple[str, ...]]:
    """Lay out the packed tensors of sibling :class:`QuantLinear` s side by side in one storage; return the groups.

    Siblings are children of one module named as in one entry of ``names`` (all of the entry present), with the same
    K, group size, dtype, device and bias presence and no act-order permutation. Each keeps its own buffers, now
    column slices of one ``[K // 8, sum N]`` qweight (and likewise scales, zeros, bias), so the numbers, the
    state dict and checkpoints do not change. What it buys: the w4a16 pass proves from the graph that the siblings'
    products read one input and the adjacent slices of one storage, and makes them one kernel call
    (``torch.ops.fxopt.w4a16_linear_cat``). Moving a module to another device or dtype afterwards copies each
    buffer on its own and ends the sharing (the pass then keeps separate calls). Costs one copy of each group's
    packed tensors while it runs."""
    groups = []
    for parent_name, parent in model.named_modules():
        children = dict(parent.named_children())
        for entry in names:
            mods = [children.get(n) for n in entry]
            if not all(isinstance(m, QuantLinear) for m in mods):
                continue
            first = mods[0]
            same = all(m.in_features == first.in_features and m.group_size == first.group_size
                       and m.scales.dtype == first.scales.dtype and m.qweight.device == first.qweight.device
                       and (m.bias is None) == (first.bias is None) and m.perm is None for m in mods)
            if not same:
                log.debug("share_sibling_storage: %s.%s differ (K, group, dtype, device, bias or act order)",
                          parent_name, entry)
                continue
            with torch.no_grad():
                for buf in ("qweight", "scales", "zeros") + (("bias",) if first.bias is not None else ()):
                    for m, v in zip(mods, _side_by_side([getattr(m, buf) for m in mods])):
                        m.register_buffer(buf, v)
            groups.append(tuple(f"{parent_name}.{n}" if parent_name else n for n in entry))
    log.debug("share_sibling_storage: %d group(s)", len(groups))
    return groups
