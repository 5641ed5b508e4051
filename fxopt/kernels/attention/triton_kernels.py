"""The Triton attention kernels (FlashAttention-2 style; every GPU, CPU under the interpreter).

``_attn_fwd`` (one program per query block and batch x head, the key range in three segments so invisible blocks
are never visited); ``_attn_fwd_split`` + ``_attn_combine``: split-KV decode (a KV group's query heads and tokens
packed into one tile, partials merged by the combine kernel or, ``FUSED_COMBINE``, by the last split to finish);
backward ``_attn_bwd_preprocess``, ``_attn_bwd_dkdv`` (no atomics, also for GQA), ``_attn_bwd_dq``, P recomputed
from the saved lse. Masks: causal bottom-right aligned, window, softcap, key padding, bool / additive float masks,
Philox dropout; a row with no visible key gives 0 and lse = +inf. ``docs/kernels.md`` ("Attention").
"""
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh through exp2: saturates cleanly to +-1 for large |x|.
    return 2.0 / (1.0 + tl.exp2(-2.8853900817779268 * x)) - 1.0


@triton.jit
def _load_rows(base, offs_r, offs_d, stride_r, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """Load a [rows, BLOCK_D] tile (last dim contiguous), zero outside rows < n_rows and d < HEAD_DIM."""
    ptrs = base + offs_r[:, None] * stride_r + offs_d[None, :]
    if CHECK_ROWS:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs, mask=offs_r[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _scores(qk, qpos, kpos, row_ok, mask_rows, stride_mn, kpm_base, stride_kpn, SEQ_Q, SEQ_K,
            sm_scale, softcap, window,
            IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
            MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, CHECK: tl.constexpr):
    """Raw q.k (fp32) -> base-2 logits with -inf where masked, plus tanh(.) for the softcap backward.

    Works in either orientation: qpos / row_ok / mask_rows broadcast along the query axis, kpos along the key axis.
    """
    if HAS_SOFTCAP:
        t = _tanh(qk * (sm_scale / softcap))
        s = t * (softcap * 1.4426950408889634)
    else:
        t = qk
        s = qk * (sm_scale * 1.4426950408889634)
    if MASK_KIND == 1:  # bool mask, True = attend
        keep = tl.load(mask_rows + kpos * stride_mn, mask=row_ok & (kpos < SEQ_K), other=0)
        s = tl.where(keep != 0, s, float("-inf"))
    if MASK_KIND == 2:  # additive float mask
        add = tl.load(mask_rows + kpos * stride_mn, mask=row_ok & (kpos < SEQ_K), other=0.0).to(tl.float32)
        # A finite fill such as finfo(fp32).min would overflow to -inf once scaled by log2(e), turning eager's
        # uniform row into an empty one: clamp finite values to a bound whose base-2 image is still finite.
        add = tl.where(add == float("-inf"), add, tl.maximum(add, -2.0e38))
        s = s + add * 1.4426950408889634
    if HAS_KPM:
        kp = tl.load(kpm_base + kpos * stride_kpn, mask=kpos < SEQ_K, other=0)
        s = tl.where(kp != 0, s, float("-inf"))
    if CHECK:
        if IS_CAUSAL:  # the Sk bound folded into each query's last visible key: one compare per element
            visible = kpos <= tl.minimum(qpos + (SEQ_K - SEQ_Q), SEQ_K - 1)
        else:
            visible = kpos < SEQ_K
        if HAS_WINDOW:
            visible = visible & ((qpos + (SEQ_K - SEQ_Q)) - kpos < window)
        s = tl.where(visible, s, float("-inf"))
    return s, t


@triton.jit
def _kv_range(start_m, SEQ_Q, SEQ_K, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key range for query rows [start_m, start_m + BLOCK_M) as lo <= full_lo <= full_hi <= hi (multiples of
    BLOCK_N except hi): [lo, full_lo) and [full_hi, hi) need per-element masks, [full_lo, full_hi) does not."""
    shift = SEQ_K - SEQ_Q
    lo = 0
    hi = SEQ_K
    full_lo = 0
    full_hi = (SEQ_K // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(hi, tl.maximum(start_m + BLOCK_M + shift, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(start_m + shift + 1, 0) // BLOCK_N) * BLOCK_N)
    if HAS_WINDOW:
        lo = (tl.maximum(start_m + shift - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M + shift - window, 0), BLOCK_N) * BLOCK_N
    lo = tl.minimum(lo, hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _q_range(start_n, SEQ_Q, SEQ_K, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query range that can see keys [start_n, start_n + BLOCK_N), split like ``_kv_range``."""
    shift = SEQ_K - SEQ_Q
    lo = 0
    hi = SEQ_Q
    full_lo = 0
    full_hi = (SEQ_Q // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:  # row i sees key j iff i >= j - shift
        lo = (tl.maximum(start_n - shift, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
    if HAS_WINDOW:  # row i sees key j iff i < j + window - shift
        hi = tl.minimum(hi, tl.maximum(start_n + BLOCK_N - 1 + window - shift, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(start_n + window - shift, 0) // BLOCK_M) * BLOCK_M)
    lo = tl.minimum(lo, hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


# Forward


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_vn,
              qpos, row_ok, mask_rows, stride_mn, kpm_base, stride_kpn, rng_rows,
              offs_d, lo, hi, SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHECK: tl.constexpr,
              IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              USE_TMA: tl.constexpr, PREC: tl.constexpr, FOLD_SCALE: tl.constexpr):
    offs_nb = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_nb
        if USE_TMA:
            k = k_desc.load([start_n, 0])
        else:
            k = _load_rows(k_base, offs_n, offs_d, stride_kn, SEQ_K, HEAD_DIM, BLOCK_D, CHECK)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if FOLD_SCALE and not (CHECK or HAS_SOFTCAP or MASK_KIND != 0 or HAS_KPM):
            # unmasked blocks, scale > 0: the row max of the raw dot, and the scale folded into the FMA that
            # subtracts it (one instruction per score instead of a multiply and a subtract)
            c = sm_scale * 1.4426950408889634
            m_new = tl.maximum(m_i, tl.max(qk, 1) * c)
            m_use = m_new
            p = tl.exp2(qk * c - m_use[:, None])
        else:
            s, t = _scores(qk, qpos, offs_n[None, :], row_ok, mask_rows, stride_mn, kpm_base, stride_kpn, SEQ_Q,
                           SEQ_K, sm_scale, softcap, window, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, MASK_KIND, HAS_KPM,
                           CHECK)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if CHECK or MASK_KIND != 0 or HAS_KPM:  # only then can a row still be empty
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = tl.rand(seed, rng_rows + offs_n[None, :]) >= dropout_p
            p = tl.where(keep, p * (1.0 / (1.0 - dropout_p)), 0.0)
        if USE_TMA:
            v = v_desc.load([start_n, 0])
        else:
            v = _load_rows(v_base, offs_n, offs_d, stride_vn, SEQ_K, HEAD_DIM, BLOCK_D, CHECK)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, MASK, KPM,
              stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
              stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
              stride_mz, stride_mh, stride_mm, stride_mn, stride_kpz, stride_kpn,
              H_Q, GROUP, SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed, TUNE_SEQ,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, PREC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FOLD_SCALE: tl.constexpr = False):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:  # heaviest query blocks first
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_hz = tl.program_id(1)
    off_z = off_hz // H_Q
    off_h = off_hz % H_Q
    off_hk = off_h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q_base = Q + off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh
    k_base = K + off_z.to(tl.int64) * stride_kz + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_z.to(tl.int64) * stride_vz + off_hk.to(tl.int64) * stride_vh
    o_base = O + off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
    if USE_TMA:
        q_desc = tl.make_tensor_descriptor(q_base, shape=[SEQ_Q, HEAD_DIM], strides=[stride_qm, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        k_desc = tl.make_tensor_descriptor(k_base, shape=[SEQ_K, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[SEQ_K, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        q = q_desc.load([start_m, 0])
    else:
        k_desc = k_base
        v_desc = v_base
        q = _load_rows(q_base, offs_m, offs_d, stride_qm, SEQ_Q, HEAD_DIM, BLOCK_D, True)

    mask_rows = MASK + off_z.to(tl.int64) * stride_mz + off_h.to(tl.int64) * stride_mh + offs_m[:, None] * stride_mm
    kpm_base = KPM + off_z.to(tl.int64) * stride_kpz
    qpos = offs_m[:, None]
    row_ok = qpos < SEQ_Q
    rng_rows = (off_hz.to(tl.int64) * SEQ_Q + offs_m[:, None]) * SEQ_K

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _kv_range(start_m, SEQ_Q, SEQ_K, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    if HAS_WINDOW:
        acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_vn,
                                  qpos, row_ok, mask_rows, stride_mn, kpm_base, stride_kpn, rng_rows,
                                  offs_d, lo, full_lo, SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed,
                                  HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                  MASK_KIND, HAS_KPM, HAS_DROPOUT, USE_TMA, PREC, FOLD_SCALE)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_vn,
                              qpos, row_ok, mask_rows, stride_mn, kpm_base, stride_kpn, rng_rows,
                              offs_d, full_lo, full_hi, SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed,
                              HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                              MASK_KIND, HAS_KPM, HAS_DROPOUT, USE_TMA, PREC, FOLD_SCALE)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_vn,
                              qpos, row_ok, mask_rows, stride_mn, kpm_base, stride_kpn, rng_rows,
                              offs_d, full_hi, hi, SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed,
                              HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                              MASK_KIND, HAS_KPM, HAS_DROPOUT, USE_TMA, PREC, FOLD_SCALE)
    # epilogue: empty rows (l == 0) give 0 and lse = +inf
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + off_hz.to(tl.int64) * SEQ_Q + offs_m, lse, mask=offs_m < SEQ_Q)
    if USE_TMA:
        o_desc = tl.make_tensor_descriptor(o_base, shape=[SEQ_Q, HEAD_DIM], strides=[stride_om, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        o_desc.store([start_m, 0], out.to(O.dtype.element_ty))
    else:
        o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM))


# Decode: split-KV forward + combine


@triton.jit
def _attn_fwd_split(Q, K, V, OPART, LPART, MASK, KPM,
                    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                    stride_vz, stride_vh, stride_vn,
                    stride_mz, stride_mh, stride_mm, stride_mn, stride_kpz, stride_kpn,
                    H_Q, GROUP, SEQ_Q, SEQ_K, SPLIT_LEN, NUM_SPLITS, sm_scale, softcap, window,
                    O, LSE, LOCKS, stride_oz, stride_oh, stride_om,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
                    HAS_KPM: tl.constexpr, PREC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                    USE_GDC: tl.constexpr = False, FUSED_COMBINE: tl.constexpr = False):
    split = tl.program_id(0)
    off_zk = tl.program_id(1)
    H_KV = H_Q // GROUP
    off_z = off_zk // H_KV
    off_hk = off_zk % H_KV
    # rows = (query head within the group, query position), packed
    rows = tl.arange(0, BLOCK_R)
    g = rows // SEQ_Q
    qi = rows % SEQ_Q
    rok = rows < GROUP * SEQ_Q
    hq = off_hk * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = (Q + off_z.to(tl.int64) * stride_qz + hq[:, None].to(tl.int64) * stride_qh + qi[:, None] * stride_qm
              + offs_d[None, :])
    q = tl.load(q_ptrs, mask=rok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + off_z.to(tl.int64) * stride_kz + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_z.to(tl.int64) * stride_vz + off_hk.to(tl.int64) * stride_vh
    mask_rows = (MASK + off_z.to(tl.int64) * stride_mz + hq[:, None].to(tl.int64) * stride_mh
                 + qi[:, None] * stride_mm)
    kpm_base = KPM + off_z.to(tl.int64) * stride_kpz

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, SEQ_K)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, k_base, v_base, stride_kn, stride_vn,
                              qi[:, None], rok[:, None], mask_rows, stride_mn, kpm_base, stride_kpn, rows[:, None],
                              offs_d, lo, hi, SEQ_Q, SEQ_K, sm_scale, softcap, window, 0.0, 0,
                              HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                              MASK_KIND, HAS_KPM, False, False, PREC, False)
    if USE_GDC:  # the combine kernel may launch now; it waits for this whole grid before reading the partials
        tl.extra.cuda.gdc_launch_dependents()
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    # partials laid out [B, Hq, Sq, NUM_SPLITS, BLOCK_D] / [B, Hq, Sq, NUM_SPLITS]
    prow = ((off_z * H_Q + hq).to(tl.int64) * SEQ_Q + qi) * NUM_SPLITS + split
    tl.store(LPART + prow, lse2, mask=rok)
    tl.store(OPART + prow[:, None] * BLOCK_D + offs_d[None, :], out, mask=rok[:, None])
    if FUSED_COMBINE:
        # The last split of this (batch, kv head) to arrive merges the partials of its rows: no second kernel.
        # A CTA barrier orders every thread's stores before the acq_rel arrival; partials are read from L2 (.cg).
        tl.debug_barrier()
        arrived = tl.atomic_add(LOCKS + off_zk, 1, sem="acq_rel")
        if arrived == NUM_SPLITS - 1:
            pbase = prow - split
            mx = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
            for s in range(0, NUM_SPLITS):
                mx = tl.maximum(mx, tl.load(LPART + pbase + s, mask=rok, other=float("-inf"), cache_modifier=".cg"))
            mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
            tot = tl.zeros([BLOCK_R], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
            for s in range(0, NUM_SPLITS):
                w = tl.exp2(tl.load(LPART + pbase + s, mask=rok, other=float("-inf"), cache_modifier=".cg") - mx_safe)
                o_s = tl.load(OPART + (pbase + s)[:, None] * BLOCK_D + offs_d[None, :], mask=rok[:, None], other=0.0,
                              cache_modifier=".cg")
                acc2 += o_s * w[:, None]
                tot += w
            tot_safe = tl.where(tot == 0.0, 1.0, tot)
            res = acc2 / tot_safe[:, None]
            lse = tl.where(tot == 0.0, float("inf"), (mx_safe + tl.log2(tot_safe)) * 0.6931471805599453)
            tl.store(LSE + (off_z * H_Q + hq).to(tl.int64) * SEQ_Q + qi, lse, mask=rok)
            o_ptrs = (O + off_z.to(tl.int64) * stride_oz + hq[:, None].to(tl.int64) * stride_oh
                      + qi[:, None] * stride_om + offs_d[None, :])
            tl.store(o_ptrs, res.to(O.dtype.element_ty), mask=rok[:, None] & (offs_d[None, :] < HEAD_DIM))
            tl.atomic_xchg(LOCKS + off_zk, 0)  # ready for the next launch


@triton.jit
def _attn_combine(OPART, LPART, O, LSE, stride_oz, stride_oh, stride_om, H_Q, SEQ_Q, NUM_SPLITS,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:  # launched with programmatic dependent launch: the split kernel's partials are complete after this
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)  # over B * Hq * Sq
    off_z = row // (H_Q * SEQ_Q)
    off_h = (row // SEQ_Q) % H_Q
    off_m = row % SEQ_Q
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NUM_SPLITS
    lse_s = tl.load(LPART + row * NUM_SPLITS + offs_s, mask=smask, other=float("-inf"))
    mx = tl.max(lse_s, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse_s - mx_safe)
    tot = tl.sum(w, 0)
    o = tl.load(OPART + (row * NUM_SPLITS + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=smask[:, None],
                other=0.0)
    tot_safe = tl.where(tot == 0.0, 1.0, tot)
    out = tl.sum(o * w[:, None], 0) / tot_safe
    lse = tl.where(tot == 0.0, float("inf"), (mx_safe + tl.log2(tot_safe)) * 0.6931471805599453)
    tl.store(LSE + row, lse)
    o_ptrs = O + off_z * stride_oz + off_h * stride_oh + off_m * stride_om + offs_d
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


# Backward


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA, stride_oz, stride_oh, stride_om, stride_doz, stride_doh, stride_dom,
                         H_Q, SEQ_Q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    off_hz = tl.program_id(1)
    off_z = off_hz // H_Q
    off_h = off_hz % H_Q
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(O + off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh, offs_m, offs_d,
                   stride_om, SEQ_Q, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + off_z.to(tl.int64) * stride_doz + off_h.to(tl.int64) * stride_doh, offs_m, offs_d,
                    stride_dom, SEQ_Q, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + off_hz.to(tl.int64) * SEQ_Q + offs_m, delta, mask=offs_m < SEQ_Q)


@triton.jit
def _bwd_kv_loop(dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, stride_qm, stride_dom,
                 stride_mm, stride_mn, kpm_base, stride_kpn, rng_base, offs_n, offs_d, lo, hi,
                 SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, CHECK: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, PREC: tl.constexpr):
    # transposed formulation: scores are [BLOCK_N (keys), BLOCK_M (queries)]
    offs_mb = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_mb
        q = _load_rows(q_base, offs_m, offs_d, stride_qm, SEQ_Q, HEAD_DIM, BLOCK_D, CHECK)
        do = _load_rows(do_base, offs_m, offs_d, stride_dom, SEQ_Q, HEAD_DIM, BLOCK_D, CHECK)
        if CHECK:
            lse = tl.load(lse_base + offs_m, mask=offs_m < SEQ_Q, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=offs_m < SEQ_Q, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        qkT = tl.dot(k, tl.trans(q), input_precision=PREC)
        qpos = offs_m[None, :]
        if CHECK or HAS_SOFTCAP or MASK_KIND != 0 or HAS_KPM:
            sT, tT = _scores(qkT, qpos, offs_n[:, None], qpos < SEQ_Q, mask_base + qpos * stride_mm, stride_mn,
                             kpm_base, stride_kpn, SEQ_Q, SEQ_K, sm_scale, softcap, window,
                             IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, MASK_KIND, HAS_KPM, CHECK)
            pT = tl.exp2(sT - lse[None, :] * 1.4426950408889634)
        else:  # unmasked block: scale and subtraction in one FMA per score
            pT = tl.exp2(qkT * (sm_scale * 1.4426950408889634) - (lse * 1.4426950408889634)[None, :])
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        if HAS_DROPOUT:
            keep = tl.rand(seed, rng_base + qpos.to(tl.int64) * SEQ_K + offs_n[:, None]) >= dropout_p
            inv_keep = 1.0 / (1.0 - dropout_p)
            pdT = tl.where(keep, pT * inv_keep, 0.0)
            dpT = tl.where(keep, dpT * inv_keep, 0.0)
        else:
            pdT = pT
        dv = tl.dot(pdT.to(do.dtype), do, dv, input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        if HAS_SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, MASK, KPM,
                   stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                   stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
                   stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                   stride_mz, stride_mh, stride_mm, stride_mn, stride_kpz, stride_kpn,
                   H_Q, GROUP, SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed, TUNE_SEQ,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
                   HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    off_zk = tl.program_id(1)
    H_KV = H_Q // GROUP
    off_z = off_zk // H_KV
    off_hk = off_zk % H_KV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + off_z.to(tl.int64) * stride_kz + off_hk.to(tl.int64) * stride_kh, offs_n, offs_d,
                   stride_kn, SEQ_K, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V + off_z.to(tl.int64) * stride_vz + off_hk.to(tl.int64) * stride_vh, offs_n, offs_d,
                   stride_vn, SEQ_K, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _q_range(start_n, SEQ_Q, SEQ_K, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    kpm_base = KPM + off_z.to(tl.int64) * stride_kpz
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        off_hz = off_z * H_Q + off_h
        q_base = Q + off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh
        do_base = DO + off_z.to(tl.int64) * stride_doz + off_h.to(tl.int64) * stride_doh
        lse_base = LSE + off_hz.to(tl.int64) * SEQ_Q
        delta_base = DELTA + off_hz.to(tl.int64) * SEQ_Q
        mask_base = MASK + off_z.to(tl.int64) * stride_mz + off_h.to(tl.int64) * stride_mh
        rng_base = off_hz.to(tl.int64) * SEQ_Q * SEQ_K
        dk, dv = _bwd_kv_loop(dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, stride_qm,
                              stride_dom, stride_mm, stride_mn, kpm_base, stride_kpn, rng_base, offs_n, offs_d,
                              lo, full_lo, SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed,
                              HEAD_DIM, BLOCK_D, BLOCK_M, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                              MASK_KIND, HAS_KPM, HAS_DROPOUT, PREC)
        dk, dv = _bwd_kv_loop(dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, stride_qm,
                              stride_dom, stride_mm, stride_mn, kpm_base, stride_kpn, rng_base, offs_n, offs_d,
                              full_lo, full_hi, SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed,
                              HEAD_DIM, BLOCK_D, BLOCK_M, False, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                              MASK_KIND, HAS_KPM, HAS_DROPOUT, PREC)
        dk, dv = _bwd_kv_loop(dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, stride_qm,
                              stride_dom, stride_mm, stride_mn, kpm_base, stride_kpn, rng_base, offs_n, offs_d,
                              full_hi, hi, SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed,
                              HEAD_DIM, BLOCK_D, BLOCK_M, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                              MASK_KIND, HAS_KPM, HAS_DROPOUT, PREC)
    dk = dk * sm_scale
    nmask = (offs_n[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)
    dk_ptrs = (DK + off_z.to(tl.int64) * stride_dkz + off_hk.to(tl.int64) * stride_dkh
               + offs_n[:, None] * stride_dkn + offs_d[None, :])
    dv_ptrs = (DV + off_z.to(tl.int64) * stride_dvz + off_hk.to(tl.int64) * stride_dvh
               + offs_n[:, None] * stride_dvn + offs_d[None, :])
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=nmask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=nmask)


@triton.jit
def _bwd_q_loop(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, qpos, row_ok, mask_rows, stride_mn,
                kpm_base, stride_kpn, rng_rows, offs_d, lo, hi, SEQ_Q, SEQ_K, sm_scale, softcap, window,
                dropout_p, seed, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                CHECK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, PREC: tl.constexpr):
    offs_nb = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_nb
        k = _load_rows(k_base, offs_n, offs_d, stride_kn, SEQ_K, HEAD_DIM, BLOCK_D, CHECK)
        v = _load_rows(v_base, offs_n, offs_d, stride_vn, SEQ_K, HEAD_DIM, BLOCK_D, CHECK)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if CHECK or HAS_SOFTCAP or MASK_KIND != 0 or HAS_KPM:
            s, t = _scores(qk, qpos, offs_n[None, :], row_ok, mask_rows, stride_mn, kpm_base, stride_kpn, SEQ_Q,
                           SEQ_K, sm_scale, softcap, window, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, MASK_KIND, HAS_KPM,
                           CHECK)
            p = tl.exp2(s - lse[:, None])
        else:  # unmasked block: scale and subtraction in one FMA per score
            p = tl.exp2(qk * (sm_scale * 1.4426950408889634) - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if HAS_DROPOUT:
            keep = tl.rand(seed, rng_rows + offs_n[None, :]) >= dropout_p
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, MASK, KPM,
                 stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                 stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
                 stride_dqz, stride_dqh, stride_dqm,
                 stride_mz, stride_mh, stride_mm, stride_mn, stride_kpz, stride_kpn,
                 H_Q, GROUP, SEQ_Q, SEQ_K, sm_scale, softcap, window, dropout_p, seed, TUNE_SEQ,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
                 HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_hz = tl.program_id(1)
    off_z = off_hz // H_Q
    off_h = off_hz % H_Q
    off_hk = off_h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh, offs_m, offs_d,
                   stride_qm, SEQ_Q, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + off_z.to(tl.int64) * stride_doz + off_h.to(tl.int64) * stride_doh, offs_m, offs_d,
                    stride_dom, SEQ_Q, HEAD_DIM, BLOCK_D, True)
    lse = tl.load(LSE + off_hz.to(tl.int64) * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=float("inf"))
    lse = lse * 1.4426950408889634
    delta = tl.load(DELTA + off_hz.to(tl.int64) * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
    k_base = K + off_z.to(tl.int64) * stride_kz + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_z.to(tl.int64) * stride_vz + off_hk.to(tl.int64) * stride_vh
    mask_rows = MASK + off_z.to(tl.int64) * stride_mz + off_h.to(tl.int64) * stride_mh + offs_m[:, None] * stride_mm
    kpm_base = KPM + off_z.to(tl.int64) * stride_kpz
    qpos = offs_m[:, None]
    row_ok = qpos < SEQ_Q
    rng_rows = (off_hz.to(tl.int64) * SEQ_Q + offs_m[:, None]) * SEQ_K
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _kv_range(start_m, SEQ_Q, SEQ_K, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    dq = _bwd_q_loop(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, qpos, row_ok, mask_rows,
                     stride_mn, kpm_base, stride_kpn, rng_rows, offs_d, lo, full_lo, SEQ_Q, SEQ_K, sm_scale,
                     softcap, window, dropout_p, seed, HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, HAS_WINDOW,
                     HAS_SOFTCAP, MASK_KIND, HAS_KPM, HAS_DROPOUT, PREC)
    dq = _bwd_q_loop(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, qpos, row_ok, mask_rows,
                     stride_mn, kpm_base, stride_kpn, rng_rows, offs_d, full_lo, full_hi, SEQ_Q, SEQ_K, sm_scale,
                     softcap, window, dropout_p, seed, HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL, HAS_WINDOW,
                     HAS_SOFTCAP, MASK_KIND, HAS_KPM, HAS_DROPOUT, PREC)
    dq = _bwd_q_loop(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, qpos, row_ok, mask_rows,
                     stride_mn, kpm_base, stride_kpn, rng_rows, offs_d, full_hi, hi, SEQ_Q, SEQ_K, sm_scale,
                     softcap, window, dropout_p, seed, HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, HAS_WINDOW,
                     HAS_SOFTCAP, MASK_KIND, HAS_KPM, HAS_DROPOUT, PREC)
    dq = dq * sm_scale
    dq_ptrs = (DQ + off_z.to(tl.int64) * stride_dqz + off_h.to(tl.int64) * stride_dqh
               + offs_m[:, None] * stride_dqm + offs_d[None, :])
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(offs_m[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _dropout_keep_kernel(KEEP, SEQ_Q, SEQ_K, dropout_p, seed, BLOCK: tl.constexpr):
    """Writes the kernels' dropout keep mask for row (b * Hq + h) * Sq + i (tests and debugging)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = tl.rand(seed, row * SEQ_K + offs) >= dropout_p
    tl.store(KEEP + row * SEQ_K + offs, keep.to(tl.int8), mask=offs < SEQ_K)
