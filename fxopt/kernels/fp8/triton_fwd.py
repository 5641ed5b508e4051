"""The Triton FP8 (e4m3) / INT8 attention forward: the op's kernel on every GPU where the Gluon build does not run.

Inputs are ``quant.quantize_qkv``'s (Q, K row-major, V transposed, fp32 block scales). S = (Q8 K8^T) q_scale k_scale
in base 2, the online softmax in fp32, P stored as p * 2^8 in e4m3 (exact shift) for the PV product, O rescaled by
alpha * vs_{j-1} / vs_j so that V's block scale is applied once in the epilogue. One warpgroup per 64 query rows and
two or three programs per SM, so one program's softmax overlaps another's tensor-core work. ``INT8``: the same
kernel on int8 codes (Q, K, V all Hadamard-transformed), s8 x s8 dots with int32 accumulation, P as
round(255 p) - 128 with V's column sums adding the offset back, the output transformed back in the epilogue.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fxopt.kernels import cdiv
from fxopt.kernels._common import INTERPRET, block_configs, keep_rows, quick_bench

from .quant import _fwht, _qblock, check_attn_inputs, hadamard_signs, quantize_blocks, quantize_qkv

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

SUM_CHUNK = 16  # rows per V column sum (int8 mode): divides every BLOCK_N


@triton.jit
def _i32_to_f32(x):
    """int32 -> fp32 for |x| < 2**22 without I2F (a quarter-rate instruction): 1.5 * 2**23 + x has x in its
    mantissa."""
    return (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _fp8_attn_loop(acc, l_i, m_i, vs_prev, q, K, VT, ks_base, vs_base, vsum_base, kv_row0, vt_row0, qk_scale, qpos,
                   lo, hi, SEQ_Q, SEQ_K, SEQ_K_PAD,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr, CHECK: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
                   INT8: tl.constexpr, SUM_CHUNK: tl.constexpr):
    # fp8: P is stored as p * 2^8 (exact); int8: p in [0, 1] is quantized to 255 levels below
    if INT8:
        p_exp = 0.0
    else:
        p_exp = 8.0
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if USE_TMA:
            k = K.load([kv_row0 + start_n, 0])
        else:
            k = tl.load(K + (kv_row0 + start_n + offs_nb)[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :])
        ks = tl.load(ks_base + start_n // QBLOCK)
        vs = tl.load(vs_base + start_n // QBLOCK)
        c = qk_scale * ks
        if INT8:
            # |q.k| <= 127^2 * 256 < 2^22: exact through the magic-number conversion (no I2F). The scores stay
            # exactly fp32(dot * c) (folding the 1.5 * 2^23 bias into the FMA would save an add but perturb them by
            # ~c, enough to flip P's rounding to 255 levels now and then).
            qk = _i32_to_f32(tl.dot(q, tl.trans(k), out_dtype=tl.int32))
        else:
            qk = tl.dot(q, tl.trans(k))
        if CHECK:
            kpos = start_n + offs_nb[None, :]
            if IS_CAUSAL:  # the Sk bound folded into each query's last visible key: one compare per element
                visible = kpos <= tl.minimum(qpos + (SEQ_K - SEQ_Q), SEQ_K - 1)
            else:
                visible = kpos < SEQ_K
            s = tl.where(visible, qk * c, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - (m_use - p_exp)[:, None])
        else:  # c > 0: max of the raw dot, scale folded into one FMA with the subtraction
            m_new = tl.maximum(m_i, tl.max(qk, 1) * c)
            m_use = m_new
            p = tl.exp2(qk * c - (m_use - p_exp)[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * (alpha * (vs_prev / vs))[:, None]
        if USE_TMA:
            vt = VT.load([vt_row0, start_n])
        else:
            vt = tl.load(VT + (vt_row0 + offs_d)[:, None].to(tl.int64) * SEQ_K_PAD + (start_n + offs_nb)[None, :])
        if INT8:
            # u = round(255 p) in [0, 255] enters an s8 x s8 dot as u - 128; 128 * colsum(V rows) adds it back.
            # The rounding is the fp32 add of 1.5 * 2^23 (round to nearest even), not a float -> int conversion
            # (F2I runs at a quarter of the FMA rate, on every element of P).
            p8 = ((p * 255.0 + 12582912.0).to(tl.int32, bitcast=True) - (0x4B400000 + 128)).to(tl.int8)
            pv = tl.dot(p8, tl.trans(vt), out_dtype=tl.int32)
            sums = tl.load(vsum_base + (start_n // SUM_CHUNK + tl.arange(0, BLOCK_N // SUM_CHUNK))[:, None] * HEAD_DIM
                           + offs_d[None, :])
            # |pv| <= 255 * 127 * 128 < 2^22: exact through the magic number, added with the column term in one add
            col = 128 * tl.sum(sums, 0) + 0x4B400000
            acc = acc + ((pv + col[None, :]).to(tl.float32, bitcast=True) - 12582912.0) * (1.0 / 255.0)
        else:
            acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc)
        m_i = m_new
        vs_prev = vs
    return acc, l_i, m_i, vs_prev


@triton.jit
def _fp8_attn_fwd(Q, K, VT, QS, KS, VS, VSUM, SIGNS, O, stride_oz, stride_oh, stride_om,
                  H_Q, H_KV, GROUP, SEQ_Q, SEQ_K, SEQ_Q_PAD, SEQ_K_PAD, sm_scale, out_norm,
                  HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, QBLOCK: tl.constexpr,
                  INT8: tl.constexpr, SUM_CHUNK: tl.constexpr, LOG2_D: tl.constexpr, UNROTATE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:  # heaviest query blocks first
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_hz = tl.program_id(1)
    off_z = off_hz // H_Q
    off_h = off_hz % H_Q
    off_kvh = off_z * H_KV + off_h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = off_hz * SEQ_Q_PAD + start_m
    kv_row0 = off_kvh * SEQ_K_PAD
    vt_row0 = off_kvh * HEAD_DIM
    if USE_TMA:
        q = Q.load([q_row, 0])
    else:
        q = tl.load(Q + (q_row + tl.arange(0, BLOCK_M))[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :])
    n_kb = SEQ_K_PAD // QBLOCK
    q_scale = tl.load(QS + off_hz * (SEQ_Q_PAD // QBLOCK) + start_m // QBLOCK)
    qk_scale = q_scale * sm_scale * 1.4426950408889634
    ks_base = KS + off_kvh * n_kb
    vs_base = VS + off_kvh * n_kb
    vsum_base = VSUM
    if INT8:
        vsum_base = VSUM + off_kvh.to(tl.int64) * (SEQ_K_PAD // SUM_CHUNK) * HEAD_DIM
    qpos = offs_m[:, None]

    # key blocks [0, full_hi) need no mask; [full_hi, hi) are cut by the causal diagonal or the sequence end
    hi = SEQ_K
    full_hi = (SEQ_K // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(hi, tl.maximum(start_m + BLOCK_M + SEQ_K - SEQ_Q, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(start_m + SEQ_K - SEQ_Q + 1, 0) // BLOCK_N) * BLOCK_N)
    full_hi = tl.minimum(full_hi, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    vs_prev = tl.load(vs_base)
    acc, l_i, m_i, vs_prev = _fp8_attn_loop(acc, l_i, m_i, vs_prev, q, K, VT, ks_base, vs_base, vsum_base,
                                            kv_row0, vt_row0, qk_scale, qpos, 0, full_hi, SEQ_Q, SEQ_K, SEQ_K_PAD,
                                            HEAD_DIM, BLOCK_N, QBLOCK, False, IS_CAUSAL, USE_TMA,
                                            INT8, SUM_CHUNK)
    acc, l_i, m_i, vs_prev = _fp8_attn_loop(acc, l_i, m_i, vs_prev, q, K, VT, ks_base, vs_base, vsum_base,
                                            kv_row0, vt_row0, qk_scale, qpos, full_hi, hi, SEQ_Q, SEQ_K, SEQ_K_PAD,
                                            HEAD_DIM, BLOCK_N, QBLOCK, True, IS_CAUSAL, USE_TMA,
                                            INT8, SUM_CHUNK)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (vs_prev / l_safe)[:, None]
    if UNROTATE:  # V was taken as V M: O = (P V M) M^T = fwht(O' * signs) / sqrt(D)
        out = _fwht(out * tl.load(SIGNS + offs_d)[None, :], BLOCK_M, HEAD_DIM, LOG2_D) * out_norm
    o_ptrs = O + off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh \
        + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < SEQ_Q)


# Configs: (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M and BLOCK_N must divide QUANT_BLOCK
# Chosen from sm_90 builds (registers, shared memory, no spills): one warpgroup per 64 query rows and two or three
# programs per SM let one program's softmax overlap another's tensor-core work (Triton 3.6 keeps a program's own
# wgmma synchronous with its softmax, and its warp specialization does not build this kernel on sm_90).
FWD_CONFIGS = {
    64: [(64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
    128: [(64, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 2)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2)],
}
INTERPRET_QBLOCK = 32


def _tma_pre_hook(nargs):
    if not nargs.get("USE_TMA"):
        return
    bm, bn, d = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM"]
    nargs["Q"].block_shape = [bm, d]
    nargs["K"].block_shape = [bn, d]
    nargs["VT"].block_shape = [d, bn]


def _prune(configs, named_args, **kwargs):
    if INTERPRET:
        return configs
    d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    return keep_rows(configs, FWD_CONFIGS.get(d, FWD_CONFIGS[128]), ordered=True)


_fp8_attn_fwd_tuned = triton.autotune(
    block_configs((r for rows in FWD_CONFIGS.values() for r in rows), _tma_pre_hook),
    key=["HEAD_DIM", "IS_CAUSAL", "USE_TMA", "SEQ_Q_PAD", "SEQ_K_PAD", "INT8"],
    prune_configs_by={"early_config_prune": _prune}, do_bench=quick_bench(25))(_fp8_attn_fwd)


def _use_tma(device) -> bool:
    if INTERPRET or TensorDescriptor is None:
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def fp8_attention_quantized(qq, qs, kq, ks, vt, vs, *, shape_q, seq_k, n_kv_heads, out_dtype, is_causal=False,
                            scale=None, out=None, qblock=None, vsum=None, signs=None):
    """Attention kernel alone, on inputs from :func:`quantize_blocks` (Q and K row-major, V transposed); shape_q =
    (B, Hq, Sq, D) of the original q, seq_k = Sk. int8 inputs need ``vsum`` (V's code column sums per
    ``SUM_CHUNK`` rows) and ``signs`` (the Hadamard signs V was transformed with; the output is transformed back)."""
    B, Hq, Sq, D = shape_q
    int8 = qq.dtype == torch.int8
    if int8 and (vsum is None or signs is None):
        raise ValueError("fp8_attention_quantized: int8 inputs need vsum and signs")
    Hkv = n_kv_heads
    qblock = qblock or _qblock()
    sq_pad, sk_pad = qq.shape[2], kq.shape[2]
    o = out if out is not None else torch.empty((B, Hq, Sq, D), device=qq.device, dtype=out_dtype)
    if B * Hq * Sq == 0:
        return o
    if seq_k == 0:
        return o.zero_()
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    use_tma = _use_tma(qq.device)
    if use_tma:
        dummy = [16, 16]
        q_arg = TensorDescriptor(qq, shape=[B * Hq * sq_pad, D], strides=[D, 1], block_shape=dummy)
        k_arg = TensorDescriptor(kq, shape=[B * Hkv * sk_pad, D], strides=[D, 1], block_shape=dummy)
        v_arg = TensorDescriptor(vt, shape=[B * Hkv * D, sk_pad], strides=[sk_pad, 1], block_shape=dummy)
    else:
        q_arg, k_arg, v_arg = qq, kq, vt
    args = (q_arg, k_arg, v_arg, qs, ks, vs, vsum if int8 else qs, signs if int8 else qs, o,
            o.stride(0), o.stride(1), o.stride(2), Hq, Hkv, Hq // Hkv, Sq, seq_k, sq_pad, sk_pad, sm_scale,
            1.0 / math.sqrt(D))
    flags = dict(HEAD_DIM=D, IS_CAUSAL=bool(is_causal), USE_TMA=bool(use_tma), QBLOCK=qblock, INT8=int8,
                 SUM_CHUNK=SUM_CHUNK if int8 else 0, LOG2_D=D.bit_length() - 1, UNROTATE=int8)
    _fp8_attn_fwd_tuned[lambda META: (cdiv(Sq, META["BLOCK_M"]), B * Hq)](*args, **flags)
    return o


def fp8_attention_triton(q, k, v, is_causal=False, scale=None, hadamard=True, seed=0, *, qdtype=None, out=None):
    """Quantize (Triton) + attention (Triton). ``qdtype=torch.float16`` runs the same kernels without fp8 (for the
    interpreter on CPU)."""
    check_attn_inputs(q, k, v, scale)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    qq, qs, kq, ks, vt, vs = quantize_qkv(q, k, v, hadamard=hadamard, seed=seed, qdtype=qdtype)
    return fp8_attention_quantized(qq, qs, kq, ks, vt, vs, shape_q=(B, Hq, Sq, D), seq_k=Sk, n_kv_heads=Hkv,
                                   out_dtype=q.dtype, is_causal=is_causal, scale=scale, out=out)


def int8_attention_triton(q, k, v, is_causal=False, scale=None, seed=0, *, out=None):
    """The INT8 design of :func:`int8_attention_reference` in Triton: Q, K, V Hadamard-transformed and quantized to
    int8 per block, s8 x s8 dots with int32 accumulation, P as round(255 p) - 128 with V's column sums added back,
    the output transformed back in the epilogue. Same kernels as the fp8 path (``INT8`` constexpr)."""
    check_attn_inputs(q, k, v, scale)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    qq, qs = quantize_blocks(q, hadamard=True, seed=seed, qdtype=torch.int8)
    kq, ks = quantize_blocks(k, hadamard=True, seed=seed, qdtype=torch.int8)
    vt, vs, vsum = quantize_blocks(v, hadamard=True, seed=seed, transpose=True, qdtype=torch.int8,
                                   sum_chunk=SUM_CHUNK)
    return fp8_attention_quantized(qq, qs, kq, ks, vt, vs, shape_q=(B, Hq, Sq, D), seq_k=Sk, n_kv_heads=Hkv,
                                   out_dtype=q.dtype, is_causal=is_causal, scale=scale, out=out, vsum=vsum,
                                   signs=hadamard_signs(D, seed, q.device))
