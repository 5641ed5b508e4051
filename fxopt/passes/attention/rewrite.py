"""The rewrite of a matched region into ``torch.ops.fxopt.flash_attention`` (every check first, then the nodes), and
the pass itself: candidates in the graph and its activation-checkpoint bodies, registered with the pass manager."""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ...config import AttentionConfig
from ..manager import PassContext, PassResult, register_pass
from ..match import tensor_val
from .graph import Builder, GraphFacts, Mutations, is_pure_eval_target, op_name
from .masks import (Keep, Lowered, Masks, call_with_dead_rows, dead_row_policy, lower, masks_out, materialize,
                    sum_additive, where_zero_fill)
from .matcher import Match, is_sdpa, match_sdpa, match_softmax, repeat_kv_source

log = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256

# Tests on CPU set this to route through the FP8 op's CPU reference (which emulates the kernel's quantization).
FP8_ALLOW_CPU_REFERENCE = False


class _Abort(Exception):
    """A check that fails while the replacement is built: the created nodes are erased, the region stays."""


@dataclass
class _Operands:
    """q, k, v shapes in the op's [B, H, S, D] layout (after permutes, the transpose of kᵀ, the repeat_kv drop)."""

    qs: list
    ks: list
    vs: list
    k_src: Optional[fx.Node] = None  # the sources of repeat_kv on both k and v (native GQA)
    v_src: Optional[fx.Node] = None


@dataclass
class _Plan:
    """What the op computes, decided before the first node is created."""

    trial: Masks  # the masks, transformers' where(keep, 0, fill) additive masks read as keep literals
    low: Optional[Lowered]  # the proven causal / window / key padding, or None (masks passed as tensors)
    dead: Optional[str]  # the fully-masked-row policy (masks.dead_row_policy); None: the op's own value is right
    dynamic: bool  # B, Sq or Sk symbolic
    training: bool


def _flash_op():
    """``torch.ops.fxopt.flash_attention.default`` or None when the kernel module cannot be imported."""
    try:
        import fxopt.kernels.ops  # noqa: F401
    except ImportError as e:  # another kernel module missing: the attention op alone is enough
        log.debug("fxopt.kernels.ops not importable (%s); importing fxopt.kernels.attention", e)
        try:
            import fxopt.kernels.attention  # noqa: F401
        except ImportError as e2:
            log.warning("attention pass: flash_attention op unavailable: %s", e2)
            return None
    op = getattr(torch.ops.fxopt, "flash_attention", None)
    return None if op is None else op.default


def _check_shapes(qs, ks, vs, qv, kv_, vv) -> str:
    if not (qv.dtype == kv_.dtype == vv.dtype) or qv.dtype not in _SUPPORTED_DTYPES:
        return f"dtypes {qv.dtype}/{kv_.dtype}/{vv.dtype} unsupported"
    if not (qv.device == kv_.device == vv.device):
        return "q/k/v on different devices"
    # B and the lengths may be symbolic (a comparison of two becomes a guard); head counts and the head dim pick the
    # kernel's configuration and must be static.
    if not all(isinstance(s, int) for s in (qs[1], qs[3], ks[1], ks[3], vs[1], vs[3])):
        return "dynamic head count or head dim"
    B, Hq, Sq, D = qs
    if list(ks) != list(vs):
        return f"k {list(ks)} and v {list(vs)} shapes differ"
    if ks[0] != B or ks[3] != D:
        return f"k/v {list(ks)} do not match q {list(qs)}"
    if ks[1] == 0 or Hq % ks[1] != 0:
        return f"Hq={Hq} is not a multiple of Hkv={ks[1]}"
    if D > _MAX_HEAD_DIM or D < 1:
        return f"head dim {D} unsupported (max {_MAX_HEAD_DIM})"
    return ""


def _bhsd_shape(m: Match, v: torch.Tensor, perm: Optional[list], kt: bool = False) -> list:
    """The shape of operand ``v`` in the op's [B, H, S, D] layout."""
    s = list(v.shape)
    if perm is not None:
        s = [s[i] for i in perm]
    if kt:
        s[-1], s[-2] = s[-2], s[-1]
    if m.three_d:
        s = [1] + s
    if m.heads is not None and len(s) == 3:
        s = [s[0] // m.heads, m.heads] + s[1:]
    return s


def _check_operands(m: Match) -> tuple[Optional[_Operands], str]:
    """q, k, v shapes, dtypes and devices the kernels take; the output dtype; no empty dim; casts that keep the
    kernel's float32 arithmetic."""
    qv, kv_, vv = tensor_val(m.q), tensor_val(m.k), tensor_val(m.v)
    if qv is None or kv_ is None or vv is None:
        return None, "missing meta val on q/k/v"
    ops = _Operands(_bhsd_shape(m, qv, m.q_perm), _bhsd_shape(m, kv_, m.k_perm, kt=m.k_is_kt),
                    _bhsd_shape(m, vv, m.v_perm))
    if len(ops.qs) != 4 or len(ops.ks) != 4 or len(ops.vs) != 4:
        return None, f"q/k/v ranks {len(ops.qs)}/{len(ops.ks)}/{len(ops.vs)} (need 4)"
    # GQA: drop repeat_kv on both k and v
    if not m.three_d and m.heads is None and m.k_perm is None and m.v_perm is None and not m.k_is_kt:
        kr, vr = repeat_kv_source(m.k), repeat_kv_source(m.v)
        if kr is not None and vr is not None and kr[1] == vr[1] and \
                tuple(tensor_val(kr[0]).shape) == tuple(tensor_val(vr[0]).shape):
            ops.k_src, ops.v_src = kr[0], vr[0]
            ops.ks, ops.vs = list(tensor_val(ops.k_src).shape), list(tensor_val(ops.v_src).shape)
    reason = _check_shapes(ops.qs, ops.ks, ops.vs, qv, kv_, vv)
    if reason:
        return None, reason
    ov = tensor_val(m.out)
    if ov is None or ov.dtype != qv.dtype:
        return None, "attention output dtype differs from q's"
    B, Hq, Sq, D = ops.qs
    sizes = zip(("B", "Hq", "Sq", "Sk", "D"), (B, Hq, Sq, ops.ks[2], D))
    empty = [n for n, x in sizes if isinstance(x, int) and x == 0]
    if empty:
        return None, f"empty dim {', '.join(empty)} = 0: the kernels are not called on empty tensors"
    bad_casts = [dt for dt in m.casts if dt not in (torch.float32, torch.float64, qv.dtype)]
    if bad_casts:
        return None, (f"cast to {bad_casts[0]} on the scores or probabilities (the kernel computes them in float32 "
                      f"for {qv.dtype} inputs; a cast to another dtype rounds them)")
    return ops, ""


def _plan_masks(m: Match, ops: _Operands, cfg: AttentionConfig, facts: GraphFacts, result: PassResult,
                dynamic: bool) -> tuple[Masks, list, Optional[Lowered]]:
    """The masks as keep literals and additive masks, lowered to causal / window / key padding where proven."""
    masks = m.masks
    # transformers' eager additive mask where(cond, 0, fill) with a fill that masks is a keep literal
    add_keep, rest_add = [], []
    for i, a in enumerate(masks.additive):
        wz = where_zero_fill(a, facts)
        add_dt = m.add_dtypes[i] if i < len(m.add_dtypes) else torch.float32
        if wz is not None and masks_out(wz[1], add_dt):
            add_keep.append((a, wz, add_dt))
        else:
            rest_add.append(a)
    trial = Masks(keeps=masks.keeps + [Keep(c) for _, (c, _), _ in add_keep],
                  fills=masks.fills + [f for _, (_, f), _ in add_keep], additive=rest_add,
                  additive_first=masks.additive_first)
    low, why = None, ""
    if trial.keeps and cfg.lower_masks and dynamic:
        why = "dynamic shapes: a mask's structure is proven at static sizes only"
    elif trial.keeps and cfg.lower_masks:
        B, Hq, Sq, _ = ops.qs
        low, why = lower(trial, facts, (B, Hq, Sq, ops.ks[2]), not m.three_d)
    if low is None and why:
        result.notes.append(f"attention {m.out.name}: mask passed as a tensor ({why})")
    return trial, add_keep, low


def _plan_dead_rows(m: Match, trial: Masks, add_keep: list, low: Optional[Lowered],
                    training: bool) -> tuple[Optional[str], str]:
    """The value of rows where every key may be masked (:func:`.masks.dead_row_policy`), or a reason."""
    if m.sdpa_causal or not (trial.keeps or trial.additive):
        possible = False
    elif low is not None:
        possible = low.kpm is not None or low.const_has_empty_row or bool(trial.additive)
    else:
        possible = True
    fp16_adds = [a for i, a in enumerate(m.masks.additive) if a in trial.additive and i < len(m.add_dtypes)
                 and m.add_dtypes[i] == torch.float16]
    if fp16_adds and possible:
        return None, ("additive mask on float16 scores: eager rounds scores + mask in float16 (a row of "
                      "finfo(float16).min fills overflows or keeps the scores), the kernel adds in float32")
    # SDPA gives a fully masked row zeros, the op's own value
    dead, why = dead_row_policy(trial, add_keep, possible and not is_sdpa(m.out), training,
                                safe_softmax=m.safe_softmax, dropout_p=m.dropout_p, softcap=m.softcap)
    if dead == "nan" and training and m.three_d:
        return None, ("rows may be fully masked in a 3-D (bmm) layout in training: eager's NaN gradients are "
                      "reproduced for the 4-D layout only")
    return dead, why


def _check_region(m: Match, ops: _Operands, trial: Masks, low: Optional[Lowered], facts: GraphFacts) -> str:
    """SDPA is_causal alone; no learned bias; no in-place write to what the op reads, or to an intermediate, between
    the region's first node and the op."""
    if m.sdpa_causal and (trial.keeps or trial.additive):
        return "SDPA is_causal with an attn_mask"
    # A learned bias (e.g. T5's position bias): the op's bias gradient needs an extra S x S pass; SDPA's does not.
    if any(getattr(tensor_val(a), "requires_grad", False) for a in m.masks.additive):
        return ("additive mask requires grad (a learned bias): left to the original, whose backward gives the bias "
                "gradient without an extra S x S pass")
    muts = facts.mutations
    reads = [m.q, ops.k_src or m.k, ops.v_src or m.v] + [lit.node for lit in trial.keeps] + list(trial.additive)
    reads += [node for node, _ in m.scale_syms if tensor_val(node) is not None]
    if low is not None and low.kpm is not None:
        reads.append(low.kpm)
    lo = min(muts.pos.get(n, 1 << 60) for n in m.matched) if m.matched else muts.pos.get(m.out, 0)
    w = muts.touching(reads, lo, muts.pos.get(m.out)) or muts.touching([n for n in m.matched if n is not m.out])
    if w is not None:
        return (f"in-place write {w.format_node()} inside the attention region: the fused op would read other values "
                "than the original")
    return ""


def _plan(m: Match, ops: _Operands, cfg: AttentionConfig, facts: GraphFacts,
          result: PassResult) -> tuple[Optional[_Plan], str]:
    qv, kv_, vv = tensor_val(m.q), tensor_val(m.k), tensor_val(m.v)
    B, _, Sq, _ = ops.qs
    dynamic = not all(isinstance(x, int) for x in (B, Sq, ops.ks[2]))
    training = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (qv, kv_, vv))
    trial, add_keep, low = _plan_masks(m, ops, cfg, facts, result, dynamic)
    dead, why = _plan_dead_rows(m, trial, add_keep, low, training)
    if not why:
        why = _check_region(m, ops, trial, low, facts)
    return (None, why) if why else (_Plan(trial, low, dead, dynamic, training), "")


def _bhsd_operands(b: Builder, m: Match, ops: _Operands) -> tuple[fx.Node, fx.Node, fx.Node]:
    """q, k, v in the op's [B, H, S, D] layout."""
    operands = ((m.q, m.q_perm), (ops.k_src or m.k, m.k_perm), (ops.v_src or m.v, m.v_perm))
    q, k, v = [x if perm is None else b.call(torch.permute, (x, perm)) for x, perm in operands]
    if m.k_is_kt:
        k = b.call(torch.transpose, (k, -2, -1))
    if m.three_d:
        q, k, v = [b.call(torch.unsqueeze, (x, 0)) for x in (q, k, v)]
    if m.heads is not None:  # [A*C, S, D] -> [A, C, S, D], the layout the chain's views give the scores
        q, k, v = (x if tensor_val(x).dim() == 4 else b.call(torch.unflatten, (x, 0, (-1, m.heads)))
                   for x in (q, k, v))
    return q, k, v


def _scale_kwargs(b: Builder, m: Match, q: fx.Node) -> tuple[fx.Node, dict]:
    kwargs: dict = {}
    if m.scale_syms:
        # a symbolic factor goes onto q, the op's scale stays a number: a custom op's float argument would
        # specialise the SymFloat (a guard on its value, a compile per size)
        for node, divides in m.scale_syms:
            q = b.call(operator.truediv if divides else operator.mul, (q, node))
        kwargs["scale"] = float(1.0 if m.scale is None else m.scale)
    elif m.scale is not None:
        kwargs["scale"] = float(m.scale)
    if m.softcap:
        kwargs["softcap"] = float(m.softcap)
    if m.dropout_p:
        kwargs["dropout_p"] = float(m.dropout_p)
    return q, kwargs


def _mask_kwargs(b: Builder, m: Match, ops: _Operands, plan: _Plan, qv: torch.Tensor) -> dict:
    """``is_causal`` / ``window`` / ``key_padding_mask`` / ``attn_mask`` of the op."""
    B, Hq, Sq, _ = ops.qs
    Sk = ops.ks[2]
    kwargs: dict = {}
    is_causal, attn_mask, low, trial = False, None, plan.low, plan.trial
    if m.sdpa_causal:
        if Sq == Sk:  # with symbolic lengths, a guard
            is_causal = True
        elif plan.dynamic:
            raise _Abort("SDPA is_causal with Sq != Sk and dynamic shapes (the top-left mask needs static sizes)")
        else:
            ones = b.call(torch.ones, (Sq, Sk), {"dtype": torch.bool, "device": qv.device})
            attn_mask = b.call(torch.tril, (ones,))
    if low is not None:
        is_causal = low.is_causal
        if low.window >= 0:
            kwargs["window"] = int(low.window)
        if low.kpm is not None:
            kpm = low.kpm
            if low.kpm_len != Sk:
                kpm = b.call(operator.getitem, (kpm, (slice(None), slice(None, Sk))))
            if tensor_val(kpm).dtype != torch.bool:
                kpm = b.call(torch.ne, (kpm, 0))
            if tensor_val(kpm).device != qv.device:
                kpm = b.call("to", (kpm, qv.device), method=True)
            kwargs["key_padding_mask"] = kpm
        attn_mask = sum_additive(b, trial.additive)
    elif trial.keeps or trial.additive:
        attn_mask = materialize(b, trial)
    if attn_mask is not None:
        mv = tensor_val(attn_mask)
        if mv.dim() > 4:
            raise _Abort("mask has more than 4 dims")
        shape = (1,) * (4 - mv.dim()) + tuple(mv.shape)
        if any(h not in (1, w) for h, w in zip(shape, (B, Hq, Sq, Sk))):
            raise _Abort(f"mask shape {tuple(mv.shape)} does not broadcast to {[B, Hq, Sq, Sk]}")
        if mv.device != qv.device:
            raise _Abort("mask on another device")
        kwargs["attn_mask"] = attn_mask
    if is_causal:
        kwargs["is_causal"] = True
    return kwargs


def _fp8_eligible(qv, kv_, vv, kwargs) -> tuple:
    """(ok, reason): the FP8 kernel takes inference attention with only ``is_causal`` and ``scale``."""
    from ...kernels.fp8 import fp8_attention_supported

    training = torch.is_grad_enabled() and any(t.requires_grad for t in (qv, kv_, vv))
    ok, why = fp8_attention_supported(qv, kv_, vv, training, allow_cpu_reference=FP8_ALLOW_CPU_REFERENCE)
    extra = sorted(set(kwargs) - {"scale", "is_causal"})
    if ok and extra:
        return False, "the fp8 kernel has no " + ", ".join(extra)
    return ok, why


def _call_op(b: Builder, m: Match, q, k, v, kwargs: dict, ops: _Operands, plan: _Plan, cfg: AttentionConfig, op,
             result: PassResult) -> fx.Node:
    """The fp8 op where it applies, else the flash_attention op (with eager's value on fully masked rows)."""
    if cfg.fp8 and plan.dead is None:
        fp8_ok, fp8_why = _fp8_eligible(tensor_val(q), tensor_val(k), tensor_val(v), kwargs)
        if fp8_ok:
            return b.call(torch.ops.fxopt.fp8_attention.default, (q, k, v),
                          {"is_causal": bool(kwargs.get("is_causal", False)), "scale": kwargs.get("scale")})
        result.notes.append(f"attention {m.out.name}: fp8 not used ({fp8_why}); fp16/bf16 flash_attention")
    if plan.dead is None:
        return b.call(op, (q, k, v), kwargs)
    return call_with_dead_rows(b, q, k, v, kwargs, plan.dead, ops.qs[1], plan.training)


def _match_layout(b: Builder, out: fx.Node, ov: torch.Tensor) -> fx.Node:
    """``out`` with the strides of the original output ``ov`` (eager's matmul layout), where they differ."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    def same(t):
        return all(statically_known_true(a == b_) for a, b_ in zip(t.stride(), ov.stride()))

    cur = tensor_val(out)
    if same(cur):
        return out
    order = sorted(range(ov.dim()), key=lambda d: ov.stride()[d], reverse=True)
    inv = [order.index(d) for d in range(ov.dim())]
    if order == list(range(ov.dim())):
        new = b.call("contiguous", (out,), method=True)
    else:
        new = b.call(torch.permute, (b.call("contiguous", (b.call(torch.permute, (out, order)),), method=True), inv))
    if not same(tensor_val(new)):
        raise _Abort(f"cannot give the output the original layout (strides {tuple(ov.stride())})")
    return new


def _graph_output(b: Builder, m: Match, out: fx.Node) -> fx.Node:
    """The op's [B, H, Sq, D] output in the original's shape and strides."""
    ov = tensor_val(m.out)
    if m.three_d:
        out = b.call(torch.squeeze, (out, 0))
    if m.heads is not None and ov.dim() == 3:
        out = b.call(torch.flatten, (out, 0, 1))
    if m.out_perm is not None:
        out = b.call(torch.permute, (out, m.out_perm))
    if tuple(tensor_val(out).shape) != tuple(ov.shape) or tensor_val(out).dtype != ov.dtype:
        raise _Abort(f"rewrite would change shape {tuple(ov.shape)} -> {tuple(tensor_val(out).shape)}")
    return _match_layout(b, out, ov)


def _emit(gm: fx.GraphModule, m: Match, cfg: AttentionConfig, op, facts: GraphFacts,
          result: PassResult) -> Optional[tuple[fx.Node, bool, Optional[dict]]]:
    """Build the flash_attention call for ``m``: (replacement node, native GQA, the lowered masks), or None (graph
    untouched). Every check runs before the first node is created."""
    ops, why = _check_operands(m)
    plan = None
    if not why:
        plan, why = _plan(m, ops, cfg, facts, result)
    if why:
        result.skip(m.out, why)
        return None
    b = Builder(gm.graph, m.out, (m.q, m.k, m.v, m.out))
    try:
        q, k, v = _bhsd_operands(b, m, ops)
        q, kwargs = _scale_kwargs(b, m, q)
        kwargs.update(_mask_kwargs(b, m, ops, plan, tensor_val(m.q)))
        out = _graph_output(b, m, _call_op(b, m, q, k, v, kwargs, ops, plan, cfg, op, result))
    except _Abort as e:
        b.undo()
        result.skip(m.out, str(e))
        return None
    except Exception as e:  # noqa: BLE001  (fake propagation refused the call: leave the graph as it was)
        b.undo()
        result.skip(m.out, f"rewrite failed: {type(e).__name__}: {e}")
        return None
    low = plan.low
    lowered = None if low is None else {"is_causal": low.is_causal, "window": low.window,
                                        "key_padding_mask": low.kpm is not None}
    return out, ops.k_src is not None or ops.qs[1] != ops.ks[1], lowered


def _erase_dead(g: fx.Graph, candidates: list) -> None:
    """Erase unused pure nodes among ``candidates`` and (transitively) their ancestors."""
    work = list(candidates)
    seen: set = set()
    while work:
        n = work.pop()
        if n in seen or n.graph is not g or n.op not in ("call_function", "call_method") or n.users:
            continue
        if not is_pure_eval_target(n) and op_name(n) != "dropout":
            continue
        try:
            if n.is_impure():
                continue
        except Exception:  # noqa: BLE001
            continue
        seen.add(n)
        inputs = list(n.all_input_nodes)
        g.erase_node(n)
        work.extend(inputs)


def _checkpoint_bodies(gm: fx.GraphModule) -> list:
    """The graph modules of ``tag_activation_checkpoint`` regions (Dynamo's form of ``torch.utils.checkpoint``)."""
    bodies = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and type(n.target).__name__ == "TagActivationCheckpoint" and n.args:
            body = n.args[0]
            if isinstance(body, fx.Node) and body.op == "get_attr":
                sub = getattr(gm, body.target, None)
                if isinstance(sub, fx.GraphModule) and sub not in bodies:
                    bodies.append(sub)
    return bodies


@register_pass("attention")
def attention_pass(gm: fx.GraphModule, cfg: AttentionConfig, ctx: PassContext) -> PassResult:
    """Rewrite every SDPA / hand-written attention it can prove into ``torch.ops.fxopt.flash_attention``, in the
    graph and in its activation-checkpoint bodies (recomputed in the backward: the op is deterministic without
    dropout, so the recomputation gives the same values; with dropout the body's attention stays as it was)."""
    result = PassResult("attention")
    for sub in [gm] + _checkpoint_bodies(gm):
        _rewrite_graph(sub, cfg, result, checkpointed=sub is not gm)
        if sub is not gm:
            sub.graph.lint()
            sub.recompile()
    return result


def _rewrite_graph(gm: fx.GraphModule, cfg: AttentionConfig, result: PassResult, checkpointed: bool) -> None:
    candidates = [n for n in gm.graph.nodes if op_name(n) in ("sdpa", "softmax") or is_sdpa(n)]
    if not candidates:
        return
    for n in gm.graph.nodes:  # a checkpoint body: Dynamo's values, as the manager does for the outer graph
        if "val" not in n.meta and "example_value" in n.meta:
            n.meta["val"] = n.meta["example_value"]
    op = _flash_op()
    if op is None:
        for n in candidates:
            result.skip(n, "torch.ops.fxopt.flash_attention is not available")
        return
    facts = GraphFacts(Mutations(gm.graph))
    for n in candidates:
        if n.graph is not gm.graph:
            continue  # erased by an earlier rewrite
        m, why = match_sdpa(n) if is_sdpa(n) else match_softmax(n, facts)
        if m is not None and checkpointed and m.dropout_p:
            m, why = None, "dropout inside an activation-checkpoint region (its recomputation must redraw the mask)"
        if m is None:
            result.skip(n, why)
            continue
        emitted = _emit(gm, m, cfg, op, facts, result)
        if emitted is None:
            continue
        new, gqa, low = emitted
        m.out.replace_all_uses_with(new)
        dead = [m.out] + list(m.matched)
        _erase_dead(gm.graph, dead + [a for d in dead for a in d.all_input_nodes])
        facts.mutations = Mutations(gm.graph)
        result.rewrites += 1
        result.notes.append(f"attention {n.name}: -> flash_attention"
                            + (" (GQA native)" if gqa else "")
                            + (" (activation checkpoint)" if checkpointed else "")
                            + ("" if not low else f" mask lowered {low}"))
