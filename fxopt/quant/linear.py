"""``QuantLinear``: an ``nn.Linear`` stand-in that holds only fxopt's packed int4 weight.

It computes ``F.linear(x[..., perm], dequantize_w4(qweight, scales, zeros, group_size), bias)``: correct eagerly, and
in a Dynamo graph the ``dequantize_w4 -> linear`` that the ``w4a16`` pass fuses into ``w4a16_linear``. Act-order
permutations are kept canonical (rows sorted by input feature inside each group, the order a checkpoint's ``g_idx``
implies), so ``load_quantized(save_quantized(m))`` is bitwise exact. See docs/architecture.md, "Quantization".
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
    """``(qweight, perm)`` with the rows of every group sorted by input feature (``perm=None`` if identity); a
    ValueError if ``perm`` is not a permutation of ``range(K)``."""
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
    """A linear layer with an int4 weight in fxopt's packed format (W4A16): buffers ``qweight`` int32 [K/8, N],
    ``scales`` / ``zeros`` [K/G, N], ``perm`` int64 [K] or None, ``bias`` [N] or None (``group_size`` -1 means K;
    ``dtype`` fp16 or bf16, fp32 for reference use). Build one with :meth:`from_packed` or :meth:`from_linear`."""

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
        """Wrap a :class:`PackedW4` (tensors used as they are; bias cast to the scales dtype; ``perm`` made
        canonical by :func:`canonical_perm`)."""
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
        """Round-to-nearest quantization of an ``nn.Linear`` (scales in ``dtype``, default the weight's if
        fp16/bf16, else fp16)."""
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

    ``fn_or_names``: a callable ``fn(name, linear) -> module or None`` (``None`` keeps it), a mapping
    ``{name: module}``, or names to replace by ``QuantLinear.from_linear(linear, **rtn_kwargs)``. Every replacement
    is computed and checked before the first is installed.
    """
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if callable(fn_or_names) and not isinstance(fn_or_names, Mapping):
        if rtn_kwargs:
            raise ValueError(f"replace_linears: keyword arguments {sorted(rtn_kwargs)} only apply to a list of names")
        new = {n: r for n, m in linears.items() if (r := fn_or_names(n, m)) is not None}
    else:
        if isinstance(fn_or_names, str):
            raise ValueError("replace_linears: pass a list of module names, not a single string")
        items = list(fn_or_names.items() if isinstance(fn_or_names, Mapping) else [(n, None) for n in fn_or_names])
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
    return list(torch.cat(parts, dim=-1).split([p.shape[-1] for p in parts], dim=-1))


def share_sibling_storage(model: nn.Module, names=SIBLING_NAMES) -> list[tuple[str, ...]]:
    """Lay out the packed tensors of sibling :class:`QuantLinear` s (children of one module named as in one entry
    of ``names``, with the same K, group size, dtype, device and bias presence, no act-order) side by side in one
    storage, each module's buffers becoming column slices of it; return the groups. Numbers and state dict do not
    change; the w4a16 pass then makes the siblings' products one ``w4a16_linear_cat`` call."""
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
