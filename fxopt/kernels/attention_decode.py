"""Persistent ("stream-K") split-KV decode attention: one loop per program over a contiguous range of key blocks.

Opt-in (``FXOPT_ATTN_DECODE_PERSISTENT=1``): correct, but on the H200 not faster than the split kernel of
``attention.py`` (3.83 against 3.91 TB/s at S = 4k, equal at 32k), so the default decode path does not use it.
Each program walks a flat range of the T = B * Hkv * ceil(Sk / BLOCK_N) key blocks, writes the output of items it covers whole
and an (output, lse) partial of items shared with a neighbouring program, merged afterwards. Masks, windows, softcap,
dropout, Sq > 16 and head dim > 256 raise ``ValueError`` (the caller falls back to the split kernel). Design notes,
resource table and measurements: ``docs/kernels.md``.
"""
from __future__ import annotations

import logging
import math
import os

import torch
import triton
import triton.language as tl

from fxopt.kernels import cdiv, has_pdl, jit_like_source, next_pow2

log = logging.getLogger(__name__)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SEQ_Q = 16
MAX_ROWS = 128

# Default build (block_n, num_warps, num_stages) and programs per SM; see offline_report / docs/kernels.md.
DEFAULT_CONFIG = dict(block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2, q_per_item=False)


@triton.jit
def _decode_persistent_kernel(Q, K, V, O, LSE, OPART, LPART,
                              stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                              stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
                              H_KV, GROUP, SEQ_Q, SEQ_K, NUM_BLOCKS, TOTAL, NUM_PROGRAMS, sm_scale,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, PREC: tl.constexpr,
                              Q_PER_ITEM: tl.constexpr, USE_GDC: tl.constexpr):
    pid = tl.program_id(0)
    lo = (pid.to(tl.int64) * TOTAL // NUM_PROGRAMS).to(tl.int32)
    hi = ((pid + 1).to(tl.int64) * TOTAL // NUM_PROGRAMS).to(tl.int32)
    rows = tl.arange(0, BLOCK_R)
    g = rows // SEQ_Q
    qi = rows % SEQ_Q
    rok = rows < GROUP * SEQ_Q
    offs_d = tl.arange(0, BLOCK_D)
    offs_nb = tl.arange(0, BLOCK_N)
    dok = offs_d < HEAD_DIM
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    q = tl.zeros([BLOCK_R, BLOCK_D], dtype=Q.dtype.element_ty)
    for t in range(lo, hi):
        item = t // NUM_BLOCKS
        blk = t - item * NUM_BLOCKS
        off_z = item // H_KV
        off_hk = item - off_z * H_KV
        hq = off_hk * GROUP + g
        # Q rows of this item (a few hundred bytes, L1/L2 hits): by default reloaded every block so that the
        # load is pipelined like K/V (one more small cp.async buffer per stage) instead of stalling at each item
        # boundary
        q_ptrs = (Q + off_z.to(tl.int64) * stride_qz + hq[:, None].to(tl.int64) * stride_qh
                  + qi[:, None] * stride_qm + offs_d[None, :])
        if Q_PER_ITEM:  # Q held in registers, loaded (not pipelined) at the start of each segment
            if (blk == 0) | (t == lo):
                q = tl.load(q_ptrs, mask=rok[:, None] & dok[None, :], other=0.0)
        else:
            q = tl.load(q_ptrs, mask=rok[:, None] & dok[None, :], other=0.0)
        offs_n = blk * BLOCK_N + offs_nb
        nok = offs_n < SEQ_K
        k_ptrs = (K + off_z.to(tl.int64) * stride_kz + off_hk.to(tl.int64) * stride_kh
                  + (offs_n[:, None] * stride_kn + offs_d[None, :]))
        k = tl.load(k_ptrs, mask=nok[:, None] & dok[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        visible = nok[None, :]
        if IS_CAUSAL:  # bottom-right aligned
            visible = visible & (offs_n[None, :] <= qi[:, None] + (SEQ_K - SEQ_Q))
        s = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = (V + off_z.to(tl.int64) * stride_vz + off_hk.to(tl.int64) * stride_vh
                  + (offs_n[:, None] * stride_vn + offs_d[None, :]))
        v = tl.load(v_ptrs, mask=nok[:, None] & dok[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
        item_start = item * NUM_BLOCKS
        last = (blk == NUM_BLOCKS - 1) | (t == hi - 1)
        if last:  # end of this program's segment of the item: flush
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc / l_safe[:, None]
            if (lo <= item_start) & (blk == NUM_BLOCKS - 1):  # the whole item: final output
                lse = tl.where(l_i == 0.0, float("inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
                row = (off_z * (H_KV * GROUP) + hq).to(tl.int64) * SEQ_Q + qi
                tl.store(LSE + row, lse, mask=rok)
                o_ptrs = (O + off_z.to(tl.int64) * stride_oz + hq[:, None].to(tl.int64) * stride_oh
                          + qi[:, None] * stride_om + offs_d[None, :])
                tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rok[:, None] & dok[None, :])
            else:  # a piece: slot 0 = this program's first segment, slot 1 = its last
                slot = tl.where(lo >= item_start, 0, 1)
                prow = (pid * 2 + slot).to(tl.int64) * BLOCK_R + rows
                lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
                tl.store(LPART + prow, lse2, mask=rok)
                tl.store(OPART + prow[:, None] * BLOCK_D + offs_d[None, :], out, mask=rok[:, None])
        m_i = tl.where(last, float("-inf"), m_i)
        l_i = tl.where(last, 0.0, l_i)
        acc = tl.where(last, 0.0, acc)
    if USE_GDC:  # the combine kernel may launch; it waits for this whole grid before reading the partials
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _decode_persistent_combine(OPART, LPART, O, LSE, stride_oz, stride_oh, stride_om,
                               H_KV, GROUP, SEQ_Q, NUM_BLOCKS, TOTAL, NUM_PROGRAMS,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                               USE_GDC: tl.constexpr):
    if USE_GDC:  # launched with programmatic dependent launch: the partials are complete after this
        tl.extra.cuda.gdc_wait()
    item = tl.program_id(0)
    first_t = item.to(tl.int64) * NUM_BLOCKS
    p0 = (((first_t + 1) * NUM_PROGRAMS - 1) // TOTAL).to(tl.int32)
    p1 = (((first_t + NUM_BLOCKS) * NUM_PROGRAMS - 1) // TOTAL).to(tl.int32)
    if p1 > p0:  # else one program covered the whole item and wrote its output
        off_z = item // H_KV
        off_hk = item - off_z * H_KV
        rows = tl.arange(0, BLOCK_R)
        g = rows // SEQ_Q
        qi = rows % SEQ_Q
        rok = rows < GROUP * SEQ_Q
        hq = off_hk * GROUP + g
        offs_d = tl.arange(0, BLOCK_D)
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        tot = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for p in range(p0, p1 + 1):
            p_lo = (first_t * 0 + p) * TOTAL // NUM_PROGRAMS  # int64 (the loop variable is int32)
            slot = tl.where(p_lo >= first_t, 0, 1)
            prow = (p * 2 + slot).to(tl.int64) * BLOCK_R + rows
            l_s = tl.load(LPART + prow, mask=rok, other=float("-inf"))
            o_s = tl.load(OPART + prow[:, None] * BLOCK_D + offs_d[None, :], mask=rok[:, None], other=0.0)
            m_new = tl.maximum(m, l_s)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            a = tl.exp2(m - m_use)
            w = tl.exp2(l_s - m_use)
            acc = acc * a[:, None] + o_s * w[:, None]
            tot = tot * a + w
            m = m_new
        tot_safe = tl.where(tot == 0.0, 1.0, tot)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        out = acc / tot_safe[:, None]
        lse = tl.where(tot == 0.0, float("inf"), (m_safe + tl.log2(tot_safe)) * 0.6931471805599453)
        row = (off_z * (H_KV * GROUP) + hq).to(tl.int64) * SEQ_Q + qi
        tl.store(LSE + row, lse, mask=rok)
        o_ptrs = (O + off_z.to(tl.int64) * stride_oz + hq[:, None].to(tl.int64) * stride_oh
                  + qi[:, None] * stride_om + offs_d[None, :])
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rok[:, None] & (offs_d[None, :] < HEAD_DIM))


# ----------------------------------------------------------------------------------------------------------------
# Host wrapper
# ----------------------------------------------------------------------------------------------------------------


def _num_sms(device) -> int:
    if device.type == "cuda":
        from fxopt.kernels.attention import _num_sms as sms  # cached per device

        return sms(device)
    return 4


def _check(q, k, v, block_n, num_warps, num_stages, ctas_per_sm, attn_mask, dropout_p, window,
           softcap, key_padding_mask):
    op = "decode_attention_persistent"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a 4-D tensor [B, H, S, D], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{op}: {name} dtype {t.dtype} unsupported (float16, bfloat16, float32)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: dtype mismatch q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: device mismatch q {q.device}, k {k.device}, v {v.device}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"{op}: k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head dim")
    if k.shape[1] == 0 or Hq % k.shape[1] != 0:
        raise ValueError(f"{op}: query heads ({Hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if not 1 <= D <= 256:
        raise ValueError(f"{op}: head dim {D} unsupported (1..256)")
    if Sq > MAX_SEQ_Q:
        raise ValueError(f"{op}: {Sq} query tokens; this decode kernel takes at most {MAX_SEQ_Q}")
    if (Hq // k.shape[1]) * Sq > MAX_ROWS:
        raise ValueError(f"{op}: GQA group {Hq // k.shape[1]} x {Sq} queries = {(Hq // k.shape[1]) * Sq} packed "
                         f"rows; at most {MAX_ROWS}")
    unsupported = [name for name, bad in (("attn_mask", attn_mask is not None), ("dropout", dropout_p != 0.0),
                                          ("window", window is not None and window >= 0),
                                          ("softcap", softcap not in (None, 0.0)),
                                          ("key_padding_mask", key_padding_mask is not None)) if bad]
    if unsupported:
        raise ValueError(f"{op}: {', '.join(unsupported)} not supported (use torch.ops.fxopt.flash_attention)")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{op}: block_n must be a power of two >= 16, got {block_n}")
    if num_warps not in (1, 2, 4, 8, 16) or num_stages < 1:
        raise ValueError(f"{op}: bad num_warps {num_warps} / num_stages {num_stages}")
    if ctas_per_sm is not None and ctas_per_sm < 1:
        raise ValueError(f"{op}: ctas_per_sm must be >= 1, got {ctas_per_sm}")


def decode_plan(B: int, Hkv: int, Sk: int, block_n: int, num_programs: int) -> dict:
    """The flattened work split (host mirror of the kernels' arithmetic; for tests and reports): total blocks T,
    blocks per item NB, programs P, and for every item the programs that touch it."""
    nb = cdiv(Sk, block_n)
    total = B * Hkv * nb
    P = max(1, min(num_programs, total))
    owner = lambda t: ((t + 1) * P - 1) // total  # noqa: E731
    items = [(owner(i * nb), owner(i * nb + nb - 1)) for i in range(B * Hkv)]
    return dict(num_blocks=nb, total=total, programs=P, item_programs=items,
                max_pieces=max(p1 - p0 + 1 for p0, p1 in items) if items else 0)


def decode_attention_persistent(q, k, v, scale=None, ctas_per_sm=None, block_n=None, num_warps=None,
                                num_stages=None, *, q_per_item=None, is_causal=False, num_programs=None, out=None,
                                lse=None,
                                attn_mask=None, dropout_p=0.0, window=-1, softcap=0.0, key_padding_mask=None):
    """Decode attention (few query tokens) with the persistent stream-K kernel; returns (out, lse).

    q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] (any strides; a tensor whose last dim is not contiguous is copied),
    fp16 / bf16 / fp32, Sq <= 16, Hq % Hkv == 0. out: like q (input dtype); lse [B, Hq, Sq] float32, natural log,
    +inf for a row with no visible key. ``ctas_per_sm`` / ``num_programs`` set the grid (P = SMs x ctas_per_sm,
    capped by the number of key blocks); block_n / num_warps / num_stages one fixed build (``DEFAULT_CONFIG``).
    ``q_per_item``: hold Q in registers, loaded once per segment (no Q cp.async buffer: less shared memory, more
    registers, a load stall at each item start) instead of a pipelined reload per block.
    ``out`` / ``lse``: preallocated outputs (written in place). attn_mask / dropout_p / window / softcap /
    key_padding_mask exist only to be refused with a clear error."""
    block_n = block_n or DEFAULT_CONFIG["block_n"]
    num_warps = num_warps or DEFAULT_CONFIG["num_warps"]
    num_stages = num_stages or DEFAULT_CONFIG["num_stages"]
    q_per_item = DEFAULT_CONFIG["q_per_item"] if q_per_item is None else q_per_item
    _check(q, k, v, block_n, num_warps, num_stages, ctas_per_sm, attn_mask, dropout_p, window, softcap,
           key_padding_mask)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    o = torch.empty_like(q) if out is None else out
    if lse is None:
        lse = torch.empty((B, Hq, Sq), device=q.device, dtype=torch.float32)
    if o.shape != q.shape or o.dtype != q.dtype or o.stride(-1) != 1:
        raise ValueError(f"decode_attention_persistent: out must be {tuple(q.shape)} {q.dtype} with a contiguous "
                         f"last dim")
    if lse.shape != (B, Hq, Sq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"decode_attention_persistent: lse must be a contiguous float32 {(B, Hq, Sq)} tensor")
    if B * Hq * Sq == 0:
        lse.fill_(float("inf"))
        return o, lse
    if Sk == 0:
        o.zero_()
        lse.fill_(float("inf"))
        return o, lse
    BLOCK_D = max(16, next_pow2(D))
    BLOCK_R = max(16, next_pow2(group * Sq))
    nb = cdiv(Sk, block_n)
    total = B * Hkv * nb
    if (Sk + block_n) * max(k.stride(2), v.stride(2)) >= 2 ** 31:
        raise ValueError(f"decode_attention_persistent: key offsets within one (batch, head) overflow int32 "
                         f"(Sk {Sk}, key strides {k.stride(2)} / {v.stride(2)})")
    if total >= 2 ** 31:
        raise ValueError(f"decode_attention_persistent: {total} key blocks (B * Hkv * ceil(Sk / block_n)) "
                         f"overflow int32; use a larger block_n")
    if num_programs is None:
        num_programs = _num_sms(q.device) * (ctas_per_sm or DEFAULT_CONFIG["ctas_per_sm"])
    P = max(1, min(int(num_programs), total))
    if _INTERPRET:
        num_stages = 1
    parts = torch.empty(P * 2 * BLOCK_R * (BLOCK_D + 1), device=q.device, dtype=torch.float32)
    n_o = P * 2 * BLOCK_R * BLOCK_D
    opart, lpart = parts[:n_o], parts[n_o:]
    pdl = not _INTERPRET and q.is_cuda and has_pdl(q.device)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_persistent_kernel[(P,)](
        q, k, v, o, lse, opart, lpart, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        Hkv, group, Sq, Sk, nb, total, P, sm_scale,
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_R=BLOCK_R, BLOCK_N=block_n, IS_CAUSAL=bool(is_causal) and Sq > 1,
        PREC=prec, Q_PER_ITEM=bool(q_per_item), USE_GDC=pdl, num_warps=num_warps, num_stages=num_stages)
    # one program per item; items finished by a single program return at once
    _decode_persistent_combine[(B * Hkv,)](
        opart, lpart, o, lse, *o.stride()[:3], Hkv, group, Sq, nb, total, P,
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_R=BLOCK_R, USE_GDC=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}))
    return o, lse


# ----------------------------------------------------------------------------------------------------------------
# Offline sm_90 build report (no GPU needed)
# ----------------------------------------------------------------------------------------------------------------


def offline_report(block_n: int = None, num_warps: int = None, num_stages: int = None, q_per_item: bool = False,
                   B: int = 8, H: int = 32, Hkv: int = 32, Sq: int = 1, Sk: int = 4096, D: int = 128,
                   dtype: str = "bf16") -> dict:
    """Build ``_decode_persistent_kernel`` for sm_90 (``GPUTarget("cuda", 90, 32)``, Triton's bundled ptxas /
    cuobjdump; run without TRITON_INTERPRET), specialized as the JIT would for contiguous inputs of this shape
    (pointers and multiple-of-16 ints get ``tt.divisibility = 16``, ints equal to 1 become constants), and report
    registers, stack (spills), shared memory, resident CTAs per SM (64K registers, 228 KB shared memory with 1 KB
    reserved per CTA) and whether the K/V loads went through cp.async (LDGSTS) buffers."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget

    block_n = block_n or DEFAULT_CONFIG["block_n"]
    num_warps = num_warps or DEFAULT_CONFIG["num_warps"]
    num_stages = num_stages or DEFAULT_CONFIG["num_stages"]
    group, BLOCK_D = H // Hkv, max(16, next_pow2(D))
    BLOCK_R = max(16, next_pow2(group * Sq))
    nb = cdiv(Sk, block_n)
    total = B * Hkv * nb
    ints = dict(stride_qz=H * Sq * D, stride_qh=Sq * D, stride_qm=D, stride_kz=Hkv * Sk * D, stride_kh=Sk * D,
                stride_kn=D, stride_vz=Hkv * Sk * D, stride_vh=Sk * D, stride_vn=D, stride_oz=H * Sq * D,
                stride_oh=Sq * D, stride_om=D, H_KV=Hkv, GROUP=group, SEQ_Q=Sq, SEQ_K=Sk, NUM_BLOCKS=nb,
                TOTAL=total, NUM_PROGRAMS=264)
    meta = dict(HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_R=BLOCK_R, BLOCK_N=block_n, IS_CAUSAL=False,
                PREC="ieee" if dtype == "fp32" else "tf32", Q_PER_ITEM=bool(q_per_item), USE_GDC=True)
    ptrs = dict(Q=f"*{dtype}", K=f"*{dtype}", V=f"*{dtype}", O=f"*{dtype}", LSE="*fp32", OPART="*fp32",
                LPART="*fp32")
    src = jit_like_source(_decode_persistent_kernel, ptrs, ints, ("sm_scale",), meta)
    compiled = triton.compile(src,
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                              num_stages=num_stages))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        use = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True).stdout
    reg, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", use).groups())
    smem = compiled.metadata.shared
    resident = min(65536 // (cdiv(reg, 8) * 8 * 32 * num_warps), (228 << 10) // (smem + 1024), 64 // num_warps, 32)
    return dict(block_n=block_n, warps=num_warps, stages=num_stages, q_per_item=bool(q_per_item), dtype=dtype, D=D,
                BLOCK_R=BLOCK_R, reg=reg, stack=stack, smem=smem, resident_ctas_per_sm=resident,
                ldgsts=len(re.findall(r"\bLDGSTS", sass)), ldg=len(re.findall(r"\bLDG\.", sass)))


if __name__ == "__main__":  # offline sm_90 builds: python -m fxopt.kernels.attention_decode [bn,warps,stages[,qpi]]
    import json
    import sys

    cfgs = [tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]] or [(64, 4, 3)]
    for c in cfgs:
        print(json.dumps(offline_report(*c)), flush=True)
