"""Masks of a matched attention region: their description (keep literals, fills, additive masks), the proofs that
lower them to causal / sliding window / key padding, which fills mask at all, and the value eager gives on rows
where every key is masked (see the "Masks" and "Exactness" sections of the package docstring)."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from ..match import tensor_val
from .graph import (Builder, GraphFacts, cast_dtype, const_eval, is_pure_eval_target, num, op_name, scalar_value,
                    try_eval, unwritten_ancestors)


@dataclass
class Keep:
    """A bool literal of the mask: ``node`` (True = attend), negated when ``negate``."""

    node: fx.Node
    negate: bool = False


@dataclass
class Masks:
    """Every mask on the score chain."""

    keeps: list = field(default_factory=list)  # Keep literals, one per replacement (masked_fill / where / bool mask)
    fills: list = field(default_factory=list)  # the value each replacement writes (-inf for bool semantics)
    additive: list = field(default_factory=list)  # float (or bool) mask nodes added to the scores
    additive_first: bool = True  # every additive mask is applied before every replacement (closer to QK)


@dataclass
class Lowered:
    """What the keep literals were proven to be."""

    is_causal: bool = False  # bottom-right
    window: int = -1
    kpm: Optional[fx.Node] = None  # placeholder P; key_padding_mask = P[:, :Sk].bool()
    kpm_len: int = 0
    const_has_empty_row: bool = False  # the constant part masks every key of some row


def masks_out(fill: float, dtype: torch.dtype) -> bool:
    """Whether writing ``fill`` into scores of ``dtype`` removes those keys: -inf, or at most finfo(dtype).min (a
    smaller finite fill, 0, +inf or NaN changes the softmax instead, and is not a mask)."""
    if fill is None or math.isnan(fill) or not dtype.is_floating_point:
        return False
    return fill == -math.inf or fill <= torch.finfo(dtype).min


def in_dtype(x: float, dtype: torch.dtype) -> float:
    """``x`` as stored in a tensor of ``dtype`` (finfo.min of a wider dtype becomes -inf in a narrower one)."""
    return float(torch.tensor(x, dtype=torch.float64).to(dtype)) if dtype.is_floating_point else x


def where_zero_fill(m: fx.Node, facts: GraphFacts) -> Optional[tuple[fx.Node, float]]:
    """(cond, fill) when the float mask ``m`` is ``where(cond, 0, fill)`` (transformers' eager mask), possibly cast
    to other float dtypes afterwards (``fill`` is then the value the last cast stores)."""
    dtypes = []
    while cast_dtype(m) is not None and isinstance(m.args[0], fx.Node) and tensor_val(m.args[0]) is not None:
        dtypes.append(cast_dtype(m))
        m = m.args[0]
    if op_name(m) != "where" or len(m.args) != 3:
        return None
    if not all(dt.is_floating_point for dt in dtypes):
        return None
    cond, a, b = m.args
    za, fb = scalar_value(a, facts), scalar_value(b, facts)
    if za != 0.0 or fb is None:
        return None
    cv = tensor_val(cond)
    if cv is None or cv.dtype != torch.bool or tensor_val(m) is None:
        return None
    for dt in [tensor_val(m).dtype] + dtypes[::-1]:
        fb = in_dtype(fb, dt)
    return cond, fb


_GATHER_METHODS = {"getitem", "unsqueeze", "view", "reshape", "expand", "contiguous", "permute", "transpose",
                   "clone", "to", "bool", "expand_as", "squeeze", "flatten"}


def _padding_probe(node: fx.Node, facts: GraphFacts) -> Optional[tuple[fx.Node, torch.Tensor]]:
    """If ``node`` is ``bool(P)`` gathered with constant indices from one placeholder P, return (P, index map)."""
    nodes = unwritten_ancestors(node, facts)
    if nodes is None:
        return None
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        return None
    p = placeholders[0]
    pv = tensor_val(p)
    v = tensor_val(node)
    if pv is None or v is None or pv.dim() != 2 or v.dtype != torch.bool:
        return None
    dep = {p}
    env: dict = {p: torch.arange(pv.numel(), dtype=torch.int64).view(tuple(pv.shape))}
    for n in nodes:
        if n is p:
            continue
        if not any(a in dep for a in n.all_input_nodes):
            if not is_pure_eval_target(n) or not try_eval(n, env):
                return None
            continue
        dep.add(n)
        name = op_name(n)
        if name not in _GATHER_METHODS or n.op == "placeholder":
            return None
        # only the gathered tensor may depend on P (indices, sizes must be constant)
        first = n.args[0] if n.args else None
        if first not in dep or any(a in dep for a in n.all_input_nodes if a is not first):
            return None
        if name in ("to", "bool"):
            nv = tensor_val(n)
            if nv is None or (nv.dtype != torch.bool and nv.dtype != tensor_val(first).dtype):
                return None  # only casts to bool (elementwise != 0) or device moves commute with the probe
            env[n] = env[first]
            continue
        if name == "getitem":
            idx = n.args[1]
            if isinstance(idx, fx.Node) and idx in dep:
                return None
        if not try_eval(n, env):
            return None
    out = env.get(node)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int64:
        return None
    return p, out


def _padding_probe_bool(n: fx.Node, facts: GraphFacts):
    """Padding literal ``P[...] != 0`` where the gathered tensor is numeric (the cast to bool is implicit)."""
    v = tensor_val(n)
    if v is None:
        return None
    # :func:`_padding_probe` with ``n`` read as if it were cast to bool
    saved = dict(n.meta)
    n.meta["val"] = torch.empty(v.shape, dtype=torch.bool, device="meta")
    try:
        return _padding_probe(n, facts)
    finally:
        n.meta.clear()
        n.meta.update(saved)


def _is_call(n: fx.Node, functions: tuple, methods: tuple) -> bool:
    return n.target in functions or (n.op == "call_method" and n.target in methods)


def _analyze_keep(lit: Keep, facts: GraphFacts) -> Optional[tuple[Optional[torch.Tensor], list]]:
    """Split ``lit`` into (constant bool tensor or None, [(placeholder, index map)]) or None if not provable."""
    const_parts: list[torch.Tensor] = []
    pads: list = []

    def found(probe) -> bool:
        if probe is not None:
            pads.append(probe)
        return probe is not None

    def visit(n: Any, positive: bool) -> bool:
        if not isinstance(n, fx.Node):
            return False
        c = const_eval(n, facts)
        if isinstance(c, torch.Tensor) and c.dtype == torch.bool:
            const_parts.append(c if positive else ~c)
            return True
        name = op_name(n)
        v = tensor_val(n)
        if name == "and_" or _is_call(n, (operator.and_, torch.logical_and, torch.bitwise_and),
                                      ("__and__", "logical_and", "bitwise_and")):
            if not positive or v is None or v.dtype != torch.bool:
                return False
            return visit(n.args[0], True) and visit(n.args[1], True)
        if _is_call(n, (operator.or_, torch.logical_or, torch.bitwise_or), ("__or__", "logical_or", "bitwise_or")):
            if positive or v is None or v.dtype != torch.bool:
                return False
            return visit(n.args[0], False) and visit(n.args[1], False)
        if name == "invert" or (n.op == "call_method" and n.target in ("logical_not", "bitwise_not", "__invert__")):
            src = tensor_val(n.args[0])
            if src is None or src.dtype != torch.bool:
                return False
            return visit(n.args[0], not positive)
        for functions, methods, keeps in (((operator.eq, torch.eq), ("eq", "__eq__"), False),
                                          ((operator.ne, torch.ne), ("ne", "__ne__"), True)):
            if _is_call(n, functions, methods):
                if num(n.args[1]) == 0.0 and isinstance(n.args[0], fx.Node):
                    return visit_bool(n.args[0], positive if keeps else not positive)
                return False
        if name in ("to", "contiguous", "expand") and v is not None and v.dtype == torch.bool \
                and tensor_val(n.args[0]) is not None and tensor_val(n.args[0]).dtype == torch.bool:
            return visit(n.args[0], positive)
        return positive and found(_padding_probe(n, facts))

    def visit_bool(n: fx.Node, positive: bool) -> bool:
        # n is any numeric tensor; the literal is bool(n) (== n != 0)
        v = tensor_val(n)
        if v is None:
            return False
        if v.dtype == torch.bool:
            return visit(n, positive)
        c = const_eval(n, facts)
        if isinstance(c, torch.Tensor):
            b = c != 0
            const_parts.append(b if positive else ~b)
            return True
        return positive and found(_padding_probe_bool(n, facts))

    if not visit(lit.node, not lit.negate):
        return None
    const = None
    for c in const_parts:
        try:
            const = c if const is None else (const & c)
        except RuntimeError:
            return None
    return const, pads


def _lower_constant(const: torch.Tensor, low: Lowered, shape4: tuple) -> str:
    """Record in ``low`` what the constant keep mask is (all-True, causal, window); a reason when it is none."""
    B, H, Sq, Sk = shape4
    if const.dim() > 4:
        return "mask has more than 4 dims"
    c4 = const.reshape((1,) * (4 - const.dim()) + tuple(const.shape))
    try:
        c4 = torch.broadcast_to(c4, (c4.shape[0], c4.shape[1], Sq, Sk))
    except RuntimeError:
        return "constant mask does not broadcast to [Sq, Sk]"
    for d, full in ((0, B), (1, H)):
        if c4.shape[d] not in (1, full):
            return "constant mask does not broadcast to the scores"
    flat = c4.reshape(-1, Sq, Sk)
    c2 = flat[0]
    if not bool((flat == c2).all()):
        return "constant mask differs across batch/heads"
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Sk)[None, :]
    off = Sk - Sq
    causal = j <= i + off
    if bool(c2.all()):
        pass
    elif torch.equal(c2, causal):
        low.is_causal = True
    else:
        w = int(c2.sum(-1).max())
        if w >= 1 and torch.equal(c2, causal & (i + off - j < w)):
            low.is_causal, low.window = True, w
        else:
            return "constant mask is neither causal (bottom-right) nor a sliding window"
    low.const_has_empty_row = not bool(c2.any(-1).all())
    return ""


def _lower_padding(pads: list, low: Lowered, shape4: tuple, bh_layout: bool) -> str:
    """Record in ``low`` the key padding input every padding literal gathers as P[b, j]; a reason when not."""
    B, H, Sq, Sk = shape4
    if not bh_layout:
        return "padding mask on a 3-D (bmm) layout"
    ps = {p for p, _ in pads}
    if len(ps) != 1:
        return "padding literals read different inputs"
    (p,) = ps
    L = tensor_val(p).shape[1]
    if tensor_val(p).shape[0] != B or L < Sk:
        return "padding input does not match [B, Sk]"
    expect = (torch.arange(B)[:, None, None, None] * L + torch.arange(Sk)[None, None, None, :]).expand(B, H, Sq, Sk)
    for _, g in pads:
        if g.dim() > 4:
            return "padding mask has more than 4 dims"
        g4 = g.reshape((1,) * (4 - g.dim()) + tuple(g.shape))
        try:
            g4 = torch.broadcast_to(g4, (B, H, Sq, Sk))
        except RuntimeError:
            return "padding mask does not broadcast to the scores"
        if not torch.equal(g4, expect):
            return "gathered padding is not P[b, j]"
    low.kpm, low.kpm_len = p, L
    return ""


def lower(masks: Masks, facts: GraphFacts, shape4: tuple, bh_layout: bool) -> tuple[Optional[Lowered], str]:
    """Prove the keep literals are causal / window / key padding; (None, reason) when not provable."""
    const = None
    pads: list = []
    for lit in masks.keeps:
        got = _analyze_keep(lit, facts)
        if got is None:
            return None, "mask is not a provable causal/window/padding pattern"
        c, p = got
        if c is not None:
            const = c if const is None else const & c
        pads += p
    low = Lowered()
    why = "" if const is None else _lower_constant(const, low, shape4)
    if not why and pads:
        why = _lower_padding(pads, low, shape4, bh_layout)
    return (None, why) if why else (low, "")


def dead_row_policy(masks: Masks, add_keep: list, possible: bool, training: bool, *, safe_softmax: bool,
                    dropout_p: float, softcap: float) -> tuple[Optional[str], str]:
    """What eager gives on a row whose every key is masked, when such rows may exist, as (policy, reason): None (none
    can, or the op already gives it), "nan" (every fill is -inf: softmax of -inf only), "nan_filled" (the same in
    training, where the rows' scores were replaced), "mean" (one finite fill: a uniform softmax, the mean of the
    values), "mean_additive" (the same through an additive fill, in training); (None, reason) when the op cannot
    reproduce it."""
    if not possible:
        return None, ""
    fills = set(masks.fills)
    if safe_softmax and (not masks.keeps or fills == {-math.inf}):
        return None, ""  # _safe_softmax gives a row of -inf 0, with a zero gradient: the op's own value
    if not masks.keeps or fills == {-math.inf}:
        replaced = len(masks.keeps) - len(add_keep)  # masked_fill / where literals: no gradient where they fill
        if not training:
            return "nan", ""
        if replaced and (add_keep or masks.additive):
            return None, ("rows may be fully masked by both -inf fills and additive masks, in training: which scores "
                          "eager's NaN gradient reaches is not reproduced")
        return ("nan_filled" if replaced else "nan"), ""
    if len(fills) != 1 or dropout_p:
        return None, (f"rows may be fully masked with fills {sorted(fills)}"
                      + (" and dropout" if dropout_p else "") + ": eager's result there cannot be reproduced")
    if add_keep:
        # scores + where(keep, 0, f): a masked row is uniform only when f swamps every score in the add's dtype
        if len(add_keep) != 1 or masks.keeps[:-1] or masks.additive:
            return None, "rows may be fully masked by several additive masks: eager's sum of fills is not reproduced"
        (_, (_, fa), add_dt), = add_keep
        if add_dt not in (torch.float32, torch.bfloat16) or abs(in_dtype(fa, add_dt)) < 1e30:
            return None, (f"rows may be fully masked and a fill of {fa} added to {add_dt} scores does not swamp them "
                          "(eager's rounded row is not reproduced)")
        if training and softcap:
            return None, "rows may be fully masked by an additive fill, with softcap, in training"
        return ("mean_additive" if training else "mean"), ""
    if masks.additive and not masks.additive_first:
        return None, "rows may be fully masked, with an additive mask after the fill"
    return "mean", ""


def call_with_dead_rows(b: Builder, q, k, v, kwargs: dict, dead: str, Hq: int, training: bool) -> fx.Node:
    """The forward op (out, lse); rows the kernel found without a visible key (lse = +inf) get eager's value, and in
    training eager's NaN gradients (docs/architecture.md, "Fully masked rows")."""
    seed = None
    if kwargs.get("dropout_p"):
        seed = b.call(torch.randint, (0, 2**31 - 1, ()), {"dtype": torch.int64})
    args = (q, k, v, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
            kwargs.get("scale"), kwargs.get("window", -1), kwargs.get("softcap", 0.0), kwargs.get("key_padding_mask"),
            seed)
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "window", "softcap", "key_padding_mask", "seed")
    pair = b.call(torch.ops.fxopt.flash_attention_fwd.default, args[:3], dict(zip(names, args[3:])))
    out = b.call(operator.getitem, (pair, 0))
    lse = b.call(operator.getitem, (pair, 1))
    is_dead = b.call(operator.getitem, (b.call(operator.eq, (lse, math.inf)), (Ellipsis, None)))
    if dead in ("nan", "nan_filled"):
        return _nan_rows(b, q, k, v, out, is_dead, dead, Hq, training)
    return _mean_rows(b, q, k, v, out, is_dead, dead, Hq, kwargs.get("scale"))


def _nan_rows(b: Builder, q, k, v, out, is_dead, dead: str, Hq: int, training: bool) -> fx.Node:
    # "nan_filled": the row's scores were replaced (masked_fill), so eager's NaN gradient stops there: only dv
    res = b.call(torch.where, (is_dead, math.nan, out))
    if training:
        poison = b.call(torch.where, (is_dead, math.nan, 0.0))  # [B, Hq, Sq, 1], float32, no gradient
        terms = [] if dead == "nan_filled" else [
            b.call("sum", (b.call(operator.mul, (q, 0.0)), -1), {"keepdim": True}, method=True)]
        Hkv = tensor_val(k).shape[1]
        for x in ((v,) if dead == "nan_filled" else (k, v)):
            t = b.call("sum", (b.call(operator.mul, (x, 0.0)), (-2, -1)), {"keepdim": True}, method=True)
            if Hkv != Hq:
                t = b.call(torch.repeat_interleave, (t, Hq // Hkv), {"dim": 1})
            terms.append(t)
        for t in terms:
            pt = b.call(operator.mul, (poison, t))
            res = b.call(operator.add, (res, b.call("to", (pt, tensor_val(out).dtype), method=True)))
    return res


def _mean_rows(b: Builder, q, k, v, out, is_dead, dead: str, Hq: int, scale: Optional[float]) -> fx.Node:
    Bv, Hkv, Sk, D = tensor_val(v).shape

    def heads(x):
        return x if Hkv == Hq else b.call(torch.repeat_interleave, (x, Hq // Hkv), {"dim": 1})

    mean = heads(b.call("mean", (v, -2), {"keepdim": True}, method=True))  # [B, Hq, 1, D]
    if dead == "mean_additive":
        # the uniform mean, with the softmax's gradient at p = 1/n written through K^T V (no S x S term):
        # X = scale/n q (K^T sg(V)) - scale (q . mean k) sg(mean v); out = mean v + X - detach(X) (docs/architecture.md)
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        vd = b.call("detach", (v,), method=True)
        ktv = heads(b.call(torch.matmul, (b.call(torch.transpose, (k, -2, -1)), vd)))  # [B, Hq, D, D]
        kbar = heads(b.call("mean", (k, -2), {"keepdim": True}, method=True))  # [B, Hq, 1, D]
        x1 = b.call(operator.mul, (b.call(torch.matmul, (q, ktv)), scale / Sk))
        qk = b.call("sum", (b.call(operator.mul, (q, kbar)), -1), {"keepdim": True}, method=True)
        x2 = b.call(operator.mul, (b.call(operator.mul, (qk, scale)), b.call("detach", (mean,), method=True)))
        x = b.call(operator.sub, (x1, x2))
        mean = b.call(operator.add, (mean, b.call(operator.sub, (x, b.call("detach", (x,), method=True)))))
    mean = b.call("to", (mean, tensor_val(out).dtype), method=True)
    return b.call(torch.where, (is_dead, mean, out))


def sum_additive(b: Builder, adds: list) -> Optional[fx.Node]:
    """The sum of the additive masks (None without any)."""
    out = None
    for a in adds:
        if not tensor_val(a).dtype.is_floating_point:  # a bool tensor added to the scores adds 1.0 where True
            a = b.call("to", (a, torch.float32), method=True)
        out = a if out is None else b.call(operator.add, (out, a))
    return out


def materialize(b: Builder, masks: Masks):
    """One tensor mask for the kernel: the keep literals as a bool mask (a masked key removed: exact with an -inf fill
    and with any fill that masks, :func:`masks_out`, except on fully masked rows, which :func:`dead_row_policy`
    handles), combined with the additive masks."""
    keep = None
    for lit in masks.keeps:
        node = b.call(operator.invert, (lit.node,)) if lit.negate else lit.node
        keep = node if keep is None else b.call(operator.and_, (keep, node))
    add = sum_additive(b, masks.additive)
    if keep is None:
        return add
    if add is None:
        return keep
    return b.call(torch.where, (keep, add, -math.inf))
