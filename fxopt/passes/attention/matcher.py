"""Matching an attention region: from a softmax over the last dim, down the probabilities to P @ V and up the score
chain (casts, masks, softcap, scales, views of the batch dims) to Q Kᵀ; and SDPA calls. Each step checks one thing
and returns a reason for a skip; the result (:class:`Match`) says what the fused op must compute."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..match import get_arg, tensor_val
from .graph import SAFE_SOFTMAX, GraphFacts, aten, cast_dtype, node_name, num, op_name, scalar_value, sym_scalar
from .masks import Keep, Masks, masks_out

_VIEWS = ("view", "reshape", "expand")
_QK = ("matmul", "bmm", "einsum")


@dataclass
class Match:
    """One attention region, as the fused op must compute it (q, k, v, out are set by the matcher)."""

    q: Optional[fx.Node] = None
    k: Optional[fx.Node] = None  # [.., Sk, D] layout (not transposed)
    v: Optional[fx.Node] = None
    out: Optional[fx.Node] = None  # node whose uses are replaced
    scale: Optional[float] = None  # None = 1/sqrt(D)
    softcap: float = 0.0
    dropout_p: float = 0.0
    masks: Masks = field(default_factory=Masks)
    sdpa_causal: bool = False  # SDPA's (top-left) is_causal
    q_perm: Optional[list] = None  # einsum: permute q into [B, H, S, D]
    k_perm: Optional[list] = None
    v_perm: Optional[list] = None
    out_perm: Optional[list] = None  # permute the op output into the graph's layout
    three_d: bool = False
    matched: list = field(default_factory=list)  # nodes replaced (erased if unused)
    k_is_kt: bool = False  # k node is kᵀ [.., D, Sk]: insert a transpose
    scale_syms: list = field(default_factory=list)  # (node, divides): symbolic (SymInt / SymFloat) scale factors
    casts: list = field(default_factory=list)  # dtypes of every cast matched on the scores / probabilities
    safe_softmax: bool = False  # aten._safe_softmax: a row of -inf gives 0, not NaN
    heads: Optional[int] = None  # C when the chain views [A*C, Sq, Sk] as [A, C, Sq, Sk]: 3-D q/k/v/out unflattened
    add_dtypes: list = field(default_factory=list)  # dtype of the scores each additive mask is added into


class _Layout:
    """Views of the scores / probabilities that only split or merge the batch dims ([A*C, Sq, Sk] <-> [A, C, Sq,
    Sk], ``expand`` to the same shape): every element keeps its (query, key) position; each split must agree on C."""

    def __init__(self):
        self.heads: Optional[int] = None

    def step(self, node: fx.Node, src: Optional[torch.Tensor], dst: Optional[torch.Tensor]) -> str:
        if src is None or dst is None:
            return "no meta val on a view of the scores"
        if op_name(node) == "expand":
            return "" if tuple(src.shape) == tuple(dst.shape) else "expand of the scores to another shape"
        if node.target is aten.view.default or node.op == "call_method" and node.target == "view":
            if any(isinstance(a, torch.dtype) for a in node.args[1:]):
                return "view of the scores as another dtype"
        if tuple(src.shape) == tuple(dst.shape):
            return ""
        if src.dim() + dst.dim() != 7 or tuple(src.shape[-2:]) != tuple(dst.shape[-2:]):
            return f"view of the scores {tuple(src.shape)} -> {tuple(dst.shape)} moves the query or key dims"
        four = src if src.dim() == 4 else dst
        three = dst if four is src else src
        heads = four.shape[1]
        if not isinstance(heads, int):
            return "view of the scores with a dynamic head count"
        if four.shape[0] * heads != three.shape[0]:
            return "view of the scores changes the batch size"
        if self.heads is not None and self.heads != heads:
            return f"views of the scores split the batch dim as {self.heads} and {heads} heads"
        self.heads = heads
        return ""


def _strip_scalar(node: fx.Node, matched: list, facts: GraphFacts, syms: list) -> tuple[fx.Node, float]:
    """Peel ``x * c`` / ``x / c`` (c a number, a constant 0-d tensor, or a symbolic number, appended to ``syms``)
    off a single-use operand chain."""
    factor = 1.0
    while True:
        name = op_name(node)
        if name not in ("mul", "div") or len(node.users) != 1:
            return node, factor
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
        c = scalar_value(b, facts)
        if c is None and name == "mul":
            c = scalar_value(a, facts)
            if c is not None:
                a = b
        sym = None
        if c is None and sym_scalar(b) is not None and isinstance(a, fx.Node) and node.kwargs.get(
                "rounding_mode") is None:
            sym, rest = (b, name == "div"), a
        elif c is None and name == "mul" and sym_scalar(a) is not None and isinstance(b, fx.Node):
            sym, rest = (a, False), b
        if sym is not None:
            syms.append(sym)
            matched.append(node)
            node = rest
            continue
        if c is None or not isinstance(a, fx.Node):
            return node, factor
        if name == "div" and node.kwargs.get("rounding_mode") is not None:
            return node, factor
        if c == 0.0 and name == "div":
            return node, factor
        factor = factor * c if name == "mul" else factor / c
        matched.append(node)
        node = a


def _is_last2_transpose(n: fx.Node) -> bool:
    name = op_name(n)
    v = tensor_val(n)
    if v is None:
        return False
    nd = v.dim()
    if name == "transpose":
        d0, d1 = get_arg(n, 1, "dim0"), get_arg(n, 2, "dim1")
        return isinstance(d0, int) and isinstance(d1, int) and {d0 % nd, d1 % nd} == {nd - 2, nd - 1}
    if name == "t" and nd == 2:
        return True
    if name == "permute":
        dims = n.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        dims = [d % nd for d in dims] if all(isinstance(d, int) for d in dims) else None
        return dims == list(range(nd - 2)) + [nd - 1, nd - 2]
    return False


def _parse_einsum(node: fx.Node):
    eq, ops = node.args[0], node.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = ops[0]
    if not isinstance(eq, str) or len(ops) != 2 or "..." in eq or "->" not in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2 or any(len(set(t)) != len(t) for t in terms + [out]):
        return None
    return terms[0], terms[1], out, ops[0], ops[1]


def _qk_einsum(node: fx.Node):
    """q, k, q_perm, k_perm for an einsum computing scores [b0, b1, q, k]."""
    p = _parse_einsum(node)
    if p is None:
        return None
    A, Bt, out, qa, kb = p
    contracted = (set(A) & set(Bt)) - set(out)
    if len(contracted) != 1 or len(out) != 4:
        return None
    (d,) = contracted
    b0, b1, qi, ki = out
    if not (b0 in A and b0 in Bt and b1 in A and b1 in Bt and qi in A and qi not in Bt and ki in Bt and ki not in A):
        return None
    if set(A) != {b0, b1, qi, d} or set(Bt) != {b0, b1, ki, d}:
        return None
    return qa, kb, [A.index(c) for c in (b0, b1, qi, d)], [Bt.index(c) for c in (b0, b1, ki, d)]


def _pv_einsum(node: fx.Node, p_node: fx.Node):
    """v, v_perm, out_perm for an einsum contracting probabilities [b0, b1, q, k] with v."""
    parsed = _parse_einsum(node)
    if parsed is None:
        return None
    A, Bt, out, x, y = parsed
    if x is p_node and y is not p_node:
        Pl, Vl, v = A, Bt, y
    elif y is p_node and x is not p_node:
        Pl, Vl, v = Bt, A, x
    else:
        return None
    if len(Pl) != 4 or len(Vl) != 4 or len(out) != 4:
        return None
    b0, b1, qi, ki = Pl
    extra = set(Vl) - {b0, b1, ki}
    if ki in out or not {b0, b1, ki} <= set(Vl) or len(extra) != 1 or qi in Vl:
        return None
    (e,) = extra
    if set(out) != {b0, b1, qi, e}:
        return None
    v_perm = [Vl.index(c) for c in (b0, b1, ki, e)]
    out_perm = [[b0, b1, qi, e].index(c) for c in out]
    return v, v_perm, out_perm


def repeat_kv_source(n: fx.Node) -> Optional[tuple[fx.Node, int]]:
    """(x, rep) when ``n`` is x [B, Hkv, S, D] repeated to [B, Hkv*rep, S, D] head-wise (repeat_kv)."""
    v = tensor_val(n)
    if v is None or v.dim() != 4:
        return None
    name = op_name(n)
    if n.op == "call_function" and n.target is torch.repeat_interleave or \
            (n.op == "call_method" and n.target == "repeat_interleave"):
        x, rep, dim = n.args[0], get_arg(n, 1, "repeats"), get_arg(n, 2, "dim")
        xv = tensor_val(x)
        if isinstance(rep, int) and dim in (1, -3) and xv is not None and xv.dim() == 4 and \
                "output_size" not in n.kwargs:
            return x, rep
        return None
    if name not in ("reshape", "view"):
        return None
    e = n.args[0]
    ev = tensor_val(e)
    if op_name(e) != "expand" or ev is None or ev.dim() != 5:
        return None
    u = e.args[0]
    uv = tensor_val(u)
    if uv is None or uv.dim() != 5 or uv.shape[2] != 1:
        return None
    Bsz, Hkv, rep, S, D = ev.shape
    if tuple(uv.shape) != (Bsz, Hkv, 1, S, D) or tuple(v.shape) != (Bsz, Hkv * rep, S, D):
        return None
    x = None
    if op_name(u) == "unsqueeze" and get_arg(u, 1, "dim") in (2, -3):
        x = u.args[0]
    elif op_name(u) == "getitem":
        idx = u.args[1]
        if isinstance(idx, tuple) and len(idx) == 5 and idx[2] is None and all(
                isinstance(s, slice) and s == slice(None) for i, s in enumerate(idx) if i != 2):
            x = u.args[0]
        elif isinstance(idx, tuple) and len(idx) == 3 and idx[0] == slice(None) and idx[1] == slice(None) and \
                idx[2] is None:
            x = u.args[0]
    if x is None:
        return None
    xv = tensor_val(x)
    if xv is None or tuple(xv.shape) != (Bsz, Hkv, S, D):
        return None
    return x, rep


_SHAPE_READERS = ("expand_as", "type_as", "size", "dim", "new_zeros", "new_ones", "new_full", "new_empty")


def _value_users(x: fx.Node) -> list:
    """Users of ``x`` that read its values: ``m.expand_as(x)``, ``m.type_as(x)``, ``x.size()`` read only its
    shape or dtype and are not counted."""
    out = []
    for u in x.users:
        if u.op == "call_method" and u.target in _SHAPE_READERS and (
                (u.target in ("expand_as", "type_as") and u.args[0] is not x and x not in u.kwargs.values())
                or (u.target not in ("expand_as", "type_as") and u.args[0] is x)):
            continue
        out.append(u)
    return out


def _chain_like(n: fx.Node) -> bool:
    """Whether ``n`` can be the score chain (comes from a matmul through elementwise ops)."""
    seen = 0
    while isinstance(n, fx.Node) and seen < 16:
        name = node_name(n)
        if name in _QK:
            return True
        if name in _VIEWS:
            n = n.args[0]
            seen += 1
            continue
        if name in ("mul", "div", "add", "masked_fill", "where", "tanh") or cast_dtype(n) is not None:
            if name == "where":
                return any(isinstance(a, fx.Node) and _chain_like(a) for a in n.args[1:])
            if name in ("mul", "add"):
                return any(isinstance(a, fx.Node) and _chain_like(a) for a in n.args[:2])
            n = n.args[0]
            seen += 1
            continue
        return False
    return False


def _chain_operand(n: Any, shape: tuple) -> bool:
    """Whether ``n`` is the score chain's side of a binary op on scores of ``shape``."""
    if not isinstance(n, fx.Node):
        return False
    v = tensor_val(n)
    return v is not None and tuple(v.shape) == shape and _chain_like(n)


def _check_softmax(sm: fx.Node, sv: torch.Tensor) -> str:
    dim = get_arg(sm, 1, "dim")
    if not isinstance(dim, int) or dim % sv.dim() != sv.dim() - 1:
        return "softmax is not over the last dim"
    sdt = sm.kwargs.get("dtype", sm.args[3] if sm.op == "call_function" and len(sm.args) > 3 else None)
    if sdt not in (None, torch.float32) and sdt != sv.dtype:
        return f"softmax dtype {sdt} unsupported"
    return ""


def _match_dropout(u: fx.Node, m: Match) -> str:
    functional = u.target is F.dropout
    p = get_arg(u, 1, "p", 0.5)
    training = get_arg(u, 2, "training" if functional else "train", True)
    if functional and get_arg(u, 3, "inplace", False):
        return "in-place dropout"
    if num(p) is None or not isinstance(training, bool):
        return "dropout with a non-constant p or training flag"
    if training and not 0 <= p < 1:
        return f"dropout p={p} (the kernel takes 0 <= p < 1)"
    if training and p > 0:
        if m.dropout_p > 0:
            return "two dropouts on the probabilities"
        m.dropout_p = float(p)
    return ""


def _walk_probabilities(sm: fx.Node, m: Match, layout: _Layout) -> tuple[Optional[fx.Node], str]:
    """Follow the probabilities through views of the batch dims, clones, casts and dropout; return the last node
    before the one that reads them (P @ V)."""
    cur = sm
    while True:
        if len(cur.users) != 1:
            return None, "attention probabilities are used elsewhere"
        (u,) = cur.users
        name = op_name(u)
        if name in _VIEWS:
            why = layout.step(u, tensor_val(cur), tensor_val(u))
        elif name == "clone" or (u.op == "call_function" and u.target is torch.clone):
            why = "" if u.kwargs.get("memory_format") in (None, torch.preserve_format, torch.contiguous_format) \
                else "clone of the probabilities with a memory format"
        elif cast_dtype(u) is not None:
            m.casts.append(cast_dtype(u))
            why = ""
        elif name == "dropout":
            why = _match_dropout(u, m)
        else:
            return cur, ""
        if why:
            return None, why
        m.matched.append(u)
        cur = u


def _match_pv(m: Match, pv: fx.Node, p: fx.Node) -> str:
    """``pv`` reads the probabilities ``p`` as P @ V: record v (and the einsum permutations)."""
    pname = op_name(pv)
    if pname in ("matmul", "bmm"):
        if pv.args[0] is not p or len(pv.args) < 2:
            return "probabilities are not the left matmul operand"
        m.v = pv.args[1]
    elif pname == "einsum":
        got = _pv_einsum(pv, p)
        if got is None:
            return "einsum equation not understood"
        m.v, m.v_perm, m.out_perm = got
    else:
        return f"probabilities feed {pname or pv.target}, not a matmul"
    return ""


@dataclass
class _Chain:
    """The walk up the score chain."""

    x: Any  # the chain node being read
    shape: tuple  # its expected shape (changes at a view of the batch dims)
    scale: float = 1.0  # the product of the scalar scales passed
    masks_done: bool = False  # a scale or softcap was passed: a mask above it is not expressible
    replaced: bool = False  # a masked_fill / where was passed: an additive mask above it comes after a fill
    mask_ranks: list = field(default_factory=list)  # (mask node, rank of the scores it is applied to)


def _step_add(x: fx.Node, xv: torch.Tensor, ch: _Chain, m: Match) -> str:
    a, b = x.args[0], x.args[1] if len(x.args) > 1 else x.kwargs.get("other")
    if x.kwargs.get("alpha", 1) != 1:
        return "add with alpha"
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return "add of a number on the scores"
    # the chain is the operand of the scores' shape; the other is the mask
    if _chain_operand(a, ch.shape):
        chain, mask = a, b
    elif _chain_operand(b, ch.shape):
        chain, mask = b, a
    else:
        return "cannot tell the scores from the mask in an add"
    mv = tensor_val(mask)
    if mv is None or not (mv.dtype.is_floating_point or mv.dtype == torch.bool):
        return f"additive mask of dtype {None if mv is None else mv.dtype}"
    m.masks.additive.append(mask)
    ch.mask_ranks.append((mask, xv.dim()))
    m.add_dtypes.append(xv.dtype)
    if ch.replaced:
        m.masks.additive_first = False
    m.matched.append(x)
    ch.x = chain
    return ""


def _step_masked_fill(x: fx.Node, xv: torch.Tensor, ch: _Chain, m: Match, facts: GraphFacts) -> str:
    mnode = get_arg(x, 1, "mask")
    fill = scalar_value(get_arg(x, 2, "value"), facts)
    if fill is None or not isinstance(mnode, fx.Node):
        return "masked_fill with a non-constant fill value"
    if not masks_out(fill, xv.dtype):
        return f"masked_fill value {fill} is neither -inf nor <= finfo({xv.dtype}).min: it does not mask"
    m.masks.keeps.append(Keep(mnode, negate=True))
    m.masks.fills.append(fill)
    ch.mask_ranks.append((mnode, xv.dim()))
    ch.replaced = True
    m.matched.append(x)
    ch.x = x.args[0]
    return ""


def _step_where(x: fx.Node, xv: torch.Tensor, ch: _Chain, m: Match, facts: GraphFacts) -> str:
    cond, a, b = x.args
    if _chain_operand(a, ch.shape) and (fill := scalar_value(b, facts)) is not None:
        m.masks.keeps.append(Keep(cond, negate=False))
        chain = a
    elif _chain_operand(b, ch.shape) and (fill := scalar_value(a, facts)) is not None:
        m.masks.keeps.append(Keep(cond, negate=True))
        chain = b
    else:
        return "where on the scores not understood"
    m.masks.fills.append(fill)
    if not masks_out(fill, xv.dtype):
        return f"where fill {fill} is neither -inf nor <= finfo({xv.dtype}).min: it does not mask"
    if not isinstance(cond, fx.Node) or tensor_val(cond) is None or tensor_val(cond).dtype != torch.bool:
        return "where condition is not a bool tensor"
    ch.mask_ranks.append((cond, xv.dim()))
    ch.replaced = True
    m.matched.append(x)
    ch.x = chain
    return ""


def _softcap_input(t: Any, c: float, facts: GraphFacts) -> Optional[fx.Node]:
    """y when ``t * c`` is the softcap ``tanh(y / c) * c`` (or ``tanh(y * (1 / c)) * c``), else None."""
    if not (isinstance(t, fx.Node) and op_name(t) == "tanh" and len(t.users) == 1 and c > 0):
        return None
    inner = t.args[0]
    if not (isinstance(inner, fx.Node) and op_name(inner) in ("mul", "div") and len(inner.users) == 1):
        return None
    ia, ib = inner.args[0], inner.args[1]
    ic = scalar_value(ib, facts)
    if ic is None and op_name(inner) == "mul":
        ic, ia = scalar_value(ia, facts), ib
    if ic is None or ic == 0 or inner.kwargs.get("rounding_mode") is not None:
        return None
    if op_name(inner) == "div":
        return ia if math.isclose(ic, c, rel_tol=1e-6) else None
    return ia if math.isclose(ic * c, 1.0, rel_tol=1e-6) else None


def _step_mul(x: fx.Node, ch: _Chain, m: Match, facts: GraphFacts) -> str:
    a, b = x.args[0], x.args[1] if len(x.args) > 1 else None
    c = scalar_value(b, facts)
    t = a
    if c is None:
        c, t = scalar_value(a, facts), b
    if c is not None and not ch.masks_done:
        y = _softcap_input(t, c, facts)
        if y is not None:  # scales below the softcap are pre-softcap: fine
            m.softcap = float(c)
            ch.masks_done = True
            m.matched += [x, t, t.args[0]]
            ch.x = y
            return ""
    if c is not None and isinstance(t, fx.Node):  # a scalar scale
        ch.scale *= c
        ch.masks_done = True
        m.matched.append(x)
        ch.x = t
        return ""
    sym = sym_scalar(b) if isinstance(a, fx.Node) else None
    if sym is None and isinstance(b, fx.Node):
        sym, a = sym_scalar(a), b
    if sym is None:
        return "mul of the scores by a non-constant tensor"
    m.scale_syms.append((sym, False))
    ch.masks_done = True
    m.matched.append(x)
    ch.x = a
    return ""


def _step_div(x: fx.Node, ch: _Chain, m: Match, facts: GraphFacts) -> str:
    other = x.args[1] if len(x.args) > 1 else x.kwargs.get("other")
    c = scalar_value(other, facts)
    if c is None and sym_scalar(other) is not None and x.kwargs.get("rounding_mode") is None \
            and isinstance(x.args[0], fx.Node):
        m.scale_syms.append((other, True))
    elif c is None or c == 0 or x.kwargs.get("rounding_mode") is not None or not isinstance(x.args[0], fx.Node):
        return "div of the scores by a non-constant tensor or by 0"
    else:
        ch.scale /= c
    ch.masks_done = True
    m.matched.append(x)
    ch.x = x.args[0]
    return ""


def _walk_scores(ch: _Chain, m: Match, layout: _Layout, facts: GraphFacts) -> str:
    """Walk ``ch`` up from the softmax input to the Q Kᵀ node (left in ``ch.x``), recording every op on the way."""
    while True:
        x = ch.x
        if not isinstance(x, fx.Node) or len(_value_users(x)) != 1:
            return "score chain has other users"
        xv = tensor_val(x)
        if xv is None or tuple(xv.shape) != ch.shape:
            return "score chain changes shape"
        name = node_name(x)
        if name in _VIEWS and isinstance(x.args[0], fx.Node):
            why = layout.step(x, tensor_val(x.args[0]), xv)
            if not why:
                m.matched.append(x)
                ch.x = x.args[0]
                ch.shape = tuple(tensor_val(ch.x).shape)
        elif cast_dtype(x) is not None:
            m.casts.append(cast_dtype(x))
            m.matched.append(x)
            ch.x = x.args[0]
            why = ""
        elif name == "add" and not ch.masks_done:
            why = _step_add(x, xv, ch, m)
        elif name == "masked_fill" and not ch.masks_done:
            why = _step_masked_fill(x, xv, ch, m, facts)
        elif name == "where" and not ch.masks_done and len(x.args) == 3:
            why = _step_where(x, xv, ch, m, facts)
        elif name == "mul":
            why = _step_mul(x, ch, m, facts)
        elif name == "div":
            why = _step_div(x, ch, m, facts)
        elif name in _QK:
            return ""
        elif name in ("add", "masked_fill", "where"):
            return "mask applied before the scale or softcap (not expressible)"
        else:
            return f"score chain op {name or x.target} not understood"
        if why:
            return why


def _match_qk(qk: fx.Node, m: Match, scale: float, facts: GraphFacts) -> str:
    """Record q and k of the Q Kᵀ node (and the scales on its operands)."""
    m.matched.append(qk)
    if op_name(qk) == "einsum":
        got = _qk_einsum(qk)
        if got is None:
            return "einsum equation not understood"
        q, k, m.q_perm, m.k_perm = got
    else:
        q, kt = qk.args[0], qk.args[1]
        if not isinstance(q, fx.Node) or not isinstance(kt, fx.Node):
            return "matmul operands are not tensors"
        kt_node, kfac = _strip_scalar(kt, m.matched, facts, m.scale_syms)
        scale *= kfac
        if _is_last2_transpose(kt_node) and len(kt_node.users) == 1:
            m.matched.append(kt_node)
            k = kt_node.args[0]
        else:
            k, m.k_is_kt = kt_node, True
    q, qfac = _strip_scalar(q, m.matched, facts, m.scale_syms)
    scale *= qfac
    if not m.k_is_kt:
        k, kfac = _strip_scalar(k, m.matched, facts, m.scale_syms)
        scale *= kfac
    m.q, m.k, m.scale = q, k, scale
    return ""


def _match_rank(m: Match, qk: fx.Node, layout: _Layout, mask_ranks: list) -> str:
    """The layout the op runs in: 4-D, 3-D (bmm) or 3-D viewed as 4-D by the chain (``m.heads``)."""
    qv, name = tensor_val(qk), op_name(qk)
    if name == "bmm" and (qv is None or qv.dim() != 3):
        return "bmm of unexpected rank"
    if name == "matmul" and (qv is None or qv.dim() not in (3, 4)):
        return "matmul of rank other than 3 or 4"
    m.three_d = name in ("bmm", "matmul") and qv.dim() == 3
    if layout.heads is not None:
        # the chain views [A*C, Sq, Sk] as [A, C, Sq, Sk] (or back): the op runs on [A, C, S, D]. A mask applied to
        # the 3-D scores broadcasts the same way in 4-D only when it does not index the merged dim.
        for mask, rank in mask_ranks:
            mv = tensor_val(mask)
            if rank == 3 and (mv is None or (mv.dim() == 3 and mv.shape[0] != 1)):
                return "a mask indexes the merged batch*heads dim of a score chain viewed as 4-D"
        if m.q_perm is not None or m.k_perm is not None or m.v_perm is not None:
            return "einsum operands in a score chain viewed as 4-D"
        m.three_d, m.heads = False, layout.heads
    return ""


def match_softmax(sm: fx.Node, facts: GraphFacts) -> tuple[Optional[Match], str]:
    """The attention region around the softmax ``sm``, or (None, reason)."""
    sv = tensor_val(sm)
    if sv is None:
        return None, "no meta val"
    why = _check_softmax(sm, sv)
    if why:
        return None, why
    m = Match(matched=[sm], safe_softmax=sm.target in SAFE_SOFTMAX)
    x_in = sm.args[0] if sm.args else sm.kwargs.get("input")
    if tensor_val(x_in) is not None and tensor_val(x_in).dtype != sv.dtype:
        m.casts.append(sv.dtype)  # softmax(x, dtype=t) casts x to t first
    layout = _Layout()
    p, why = _walk_probabilities(sm, m, layout)
    if why:
        return None, why
    (m.out,) = p.users
    why = _match_pv(m, m.out, p)
    if why:
        return None, why
    ch = _Chain(x=x_in, shape=tuple(sv.shape))
    why = (_walk_scores(ch, m, layout, facts) or _match_qk(ch.x, m, ch.scale, facts)
           or _match_rank(m, ch.x, layout, ch.mask_ranks))
    return (None, why) if why else (m, "")


def is_sdpa(n: fx.Node) -> bool:
    return op_name(n) == "sdpa" or (n.op == "call_function" and n.target is torch._C._nn.scaled_dot_product_attention)


def match_sdpa(node: fx.Node) -> tuple[Optional[Match], str]:
    """The SDPA call ``node`` as a :class:`Match`, or (None, reason)."""
    q, k, v, mask = (get_arg(node, i, name) for i, name in enumerate(("query", "key", "value", "attn_mask")))
    dropout_p, is_causal = get_arg(node, 4, "dropout_p", 0.0), get_arg(node, 5, "is_causal", False)
    scale, enable_gqa = get_arg(node, 6, "scale"), get_arg(node, 7, "enable_gqa", False)
    if not all(isinstance(x, fx.Node) for x in (q, k, v)):
        return None, "q/k/v are not tensors"
    if num(dropout_p) is None or not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
        return None, "non-constant dropout_p / is_causal / enable_gqa"
    sym = None
    if scale is not None and num(scale) is None:
        sym = sym_scalar(scale)
        if sym is None:
            return None, "scale is neither a number nor a symbolic number"
    if not 0 <= float(dropout_p) < 1:
        return None, f"dropout_p={dropout_p} (the kernel takes 0 <= p < 1)"
    qv, kv_ = tensor_val(q), tensor_val(k)
    if qv is None or kv_ is None:
        return None, "missing meta val"
    if qv.dim() == 4 and kv_.dim() == 4 and qv.shape[1] != kv_.shape[1] and not enable_gqa:
        return None, "different head counts without enable_gqa"
    if qv.dim() != 4:
        return None, f"q rank {qv.dim()} (need 4)"
    m = Match(q=q, k=k, v=v, out=node, scale=None if scale is None else 1.0 if sym is not None else float(scale),
              scale_syms=[] if sym is None else [(sym, False)],
              dropout_p=float(dropout_p), sdpa_causal=is_causal, matched=[node])
    if mask is not None:
        if not isinstance(mask, fx.Node) or tensor_val(mask) is None:
            return None, "attn_mask is not a tensor"
        if is_causal:
            return None, "attn_mask together with is_causal"
        if tensor_val(mask).dtype == torch.bool:
            m.masks.keeps.append(Keep(mask))
            m.masks.fills.append(-math.inf)  # SDPA's bool semantics: fully masked rows give 0, like the kernel
        elif tensor_val(mask).dtype.is_floating_point:
            m.masks.additive.append(mask)
        else:
            return None, f"attn_mask dtype {tensor_val(mask).dtype}"
    return m, ""
