"""GPU check of the Gluon attention forward's variants against a float64 reference: ``variant="overlap"`` (what
the op routes d = 128 to; checked on the H200 in session 7), the opt-in ``variant="overlap2"`` (P cast by packed
inline-PTX cvt; docs/notes_attention_fwd_session7.md) and the opt-in persistent grid ``variant="persistent"`` /
``"persistent_lpt"`` (one CTA per SM looping over work items, d = 64 / 128; offline sm_90 SASS only so far,
docs/notes_attention_fwd_session8.md) and the opt-in ``variant="pingpong"`` (the overlap build with named-barrier
turns between the two consumer warpgroups; offline only so far, docs/notes_attention_pingpong_session8.md).
overlap2, pingpong and every persistent run must be BIT-IDENTICAL to "overlap" (same arithmetic per tile); the persistent runs also use ``num_sms`` = 1 and 3, which put many work items (and both Q
buffers, several mbarrier phases) on each CTA, the schedules 0 / 1 / 2, ``write_lse=False`` and a [B, S, H, D]
layout. ``variant="persistent_pingpong"`` (session 9, offline only so far: the persistent kernel with the ping-pong
turns chained across a CTA's items) is checked like persistent (bit-identical to overlap, 1 / 3 / all SMs).
``variant="persistent3"`` (session 10, offline only so far: three consumer warpgroups, 192-row query tiles, d = 64
only; add it to ``VCHECK_VARIANTS``) has other tiles than overlap, so it is NOT compared bitwise: out / lse against
the float64 reference with overlap's tolerance (|out - ref| <= 2 |default - ref| + 2e-3, lse error < 1e-3, rows
with no visible key out = 0 / lse = +inf), on every d = 64 case with 1 / 3 / all SMs and lse off. Then
timing of overlap, pingpong, overlap2, persistent, persistent_pingpong (and persistent_lpt, causal) in three rounds
with the order rotated each round, the median printed per variant with the rounds' times. ``VCHECK_TIMING_ONLY=1``
skips the correctness cases. ``VCHECK_ROWSUM=1`` adds "persistent+rowsum", "persistent+rowsum-nopin" (and
"persistent3+rowsum" with persistent3 in VCHECK_VARIANTS) to the timing rows, each checked against float64 on head 0
of the row first (mma_rowsum, session 10; docs/notes_attention_rowsum_session10.md).

``python benchmarks/gluon_attention_variant_check.py [--quick] [--out DIR]`` (the flags are accepted for
device_session.sh; the output is printed). ``VCHECK_VARIANTS`` (comma list, default
"overlap2,persistent,persistent_lpt,pingpong") limits the opt-in variants checked and timed, so that one call's
compiles fit the watchdog (device_session.sh runs the persistent and the pingpong builds in two invocations). A persistent or pingpong launch that does not finish within 20 s is
reported as a HANG (a wrong mbarrier phase / named-barrier turn) and the script exits with status 3; the whole script has a 170 s watchdog.
"""
import faulthandler
import os
import time

faulthandler.dump_traceback_later(170, exit=True)  # a wrong mbarrier phase would hang
import math, sys, torch, triton
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import fxopt.kernels.attention_gluon as G
from gluon_attention_check import reference, _inputs
from common import round_order  # noqa: E402
torch.backends.cuda.matmul.allow_tf32 = False
T0 = time.time()
CHECK = set(os.environ.get("VCHECK_VARIANTS", "overlap2,persistent,persistent_lpt,pingpong").split(","))
if "persistent_pingpong" in CHECK:  # failed bit-identity in session 10; the kernel refuses it without this
    os.environ.setdefault("FXOPT_ATTN_GLUON_UNCHECKED", "1")
# VCHECK_POLY="2,4": also time variant="persistent" with poly_exp = each value (the FMA-pipe exp2 share; not
# bit-identical, so its correctness is the GPU test test_gpu_gluon_persistent_poly_exp), as "persistent~pK".
POLY = [int(x) for x in os.environ.get("VCHECK_POLY", "").split(",") if x.strip()]
# VCHECK_ROWSUM=1: also time "persistent+rowsum" (mma_rowsum=True: the softmax row sum by wgmma, session 10) and
# "persistent+rowsum-nopin" (mma_rowsum="nopin"), and "persistent3+rowsum" when persistent3 is in VCHECK_VARIANTS.
# Not bit-identical to persistent (the rounded P is summed): correctness is tests/test_attention_gluon_rowsum.py
# -m gpu (float64 reference); here one float64 check per timing row before it is timed.
ROWSUM = os.environ.get("VCHECK_ROWSUM") == "1"


def _fwd(q, k, v, causal, name):
    """gluon_attention_fwd for a timing name: a variant, "persistent~pK" (poly_exp=K) or "<variant>+rowsum[-nopin]"."""
    if "+rowsum" in name:
        vr, mode = name.split("+")
        return G.gluon_attention_fwd(q, k, v, causal=causal, variant=vr,
                                     mma_rowsum="nopin" if mode.endswith("-nopin") else True)
    if "~p" in name:
        vr, kk = name.split("~p")
        return G.gluon_attention_fwd(q, k, v, causal=causal, variant=vr, poly_exp=int(kk))
    return G.gluon_attention_fwd(q, k, v, causal=causal, variant=name)


def finish_or_die(label, timeout=20.0):
    """Wait for the GPU with a deadline: a persistent kernel with a wrong phase spins forever."""
    ev = torch.cuda.Event()
    ev.record()
    t = time.time()
    while not ev.query():
        if time.time() - t > timeout:
            print(f"HANG: {label} did not finish within {timeout:.0f} s (mbarrier phase bookkeeping?)", flush=True)
            os._exit(3)
        time.sleep(0.001)


cases = [(2, 2, 2, 128, 128, 64, torch.bfloat16, True), (2, 2, 2, 1024, 1024, 64, torch.bfloat16, False),
         (2, 2, 2, 200, 200, 128, torch.bfloat16, False), (2, 2, 2, 1024, 1024, 128, torch.bfloat16, True),
         (2, 2, 2, 1024, 1024, 128, torch.float16, False), (1, 2, 2, 100, 300, 128, torch.bfloat16, True),
         (1, 2, 2, 300, 100, 128, torch.bfloat16, True), (2, 4, 2, 256, 256, 64, torch.bfloat16, True),
         (1, 2, 2, 77, 333, 64, torch.bfloat16, False), (2, 2, 2, 1, 50, 128, torch.bfloat16, False),
         (1, 2, 2, 512, 512, 256, torch.bfloat16, True)]
if "persistent3" in CHECK:  # Sq > Sk causal at d = 64 (rows with no visible key; 300 = 192 + 108: a ragged 2nd tile)
    cases.append((1, 2, 2, 300, 100, 64, torch.bfloat16, True))
if os.environ.get("VCHECK_TIMING_ONLY") == "1":  # a second invocation that only times (its compiles fit the watchdog)
    cases = []
ok = True
for B, Hq, Hkv, Sq, Sk, D, dt, causal in cases:
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, dt)
    o0, l0 = G.gluon_attention_fwd(q, k, v, causal=causal)
    o1, l1 = G.gluon_attention_fwd(q, k, v, causal=causal, variant="overlap")
    o2, l2 = G.gluon_attention_fwd(q, k, v, causal=causal, variant="overlap2") if "overlap2" in CHECK else (o1, l1)
    torch.cuda.synchronize()
    ro, rl, empty = reference(q, k, v, causal, 1.0 / math.sqrt(D), torch.float64)
    fin = ~empty
    e_ref = (o1.double() - ro).abs().max().item()
    e_def = (o0.double() - ro).abs().max().item()
    e_vd = (o1.float() - o0.float()).abs().max().item()
    e_lse = (l1.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    e_ref2 = (o2.double() - ro).abs().max().item()
    e_lse2 = (l2.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    same2 = torch.equal(o2, o1) and torch.equal(l2, l1)  # overlap2 only changes how P is packed: bit-identical
    good = (not torch.isnan(o1).any() and e_ref <= 2 * e_def + 2e-3 and e_lse < 1e-3
            and bool(torch.isposinf(l1[empty]).all()) and bool((o1[empty.unsqueeze(-1).expand_as(o1)] == 0).all()))
    good2 = (not torch.isnan(o2).any() and e_ref2 <= 2 * e_def + 2e-3 and e_lse2 < 1e-3 and same2
             and bool(torch.isposinf(l2[empty]).all()) and bool((o2[empty.unsqueeze(-1).expand_as(o2)] == 0).all()))
    ok &= good and good2
    line = (f"B{B} Hq{Hq} Hkv{Hkv} Sq{Sq} Sk{Sk} d{D} {dt} causal={causal}: |ovl-ref|={e_ref:.3g} "
            f"|def-ref|={e_def:.3g} |ovl-def|={e_vd:.3g} lse_err={e_lse:.3g} {'PASS' if good else 'FAIL'} | "
            f"|ovl2-ref|={e_ref2:.3g} lse_err2={e_lse2:.3g} ovl2==ovl bitwise {same2} {'PASS' if good2 else 'FAIL'}")
    if D in G._PERSISTENT_HEAD_DIMS and "persistent" in CHECK:
        # persistent == overlap bit for bit (out and lse), which carries overlap's reference check over; num_sms
        # 1 / 3 put all / a third of the items on each CTA (SCHED 1 / 2 for causal, 0 otherwise); lpt only at d 128
        runs = [("persistent", None), ("persistent", 3), ("persistent", 1)]
        if causal and D == 128 and "persistent_lpt" in CHECK:
            runs += [("persistent_lpt", 3), ("persistent_lpt", 1)]
        if "persistent_pingpong" in CHECK:  # turns chained across a CTA's items: 1 and 3 SMs give many items
            runs += [("persistent_pingpong", None), ("persistent_pingpong", 3), ("persistent_pingpong", 1)]
        res = []
        for vr, n in runs:
            op, lp = G.gluon_attention_fwd(q, k, v, causal=causal, variant=vr, num_sms=n)
            finish_or_die(f"{vr} num_sms={n} B{B} Hq{Hq} Sq{Sq} Sk{Sk} d{D} causal={causal}")
            res.append(f"{vr}/{n or 'all'} {torch.equal(op, o1) and torch.equal(lp, l1)}")
        if D == 128 and dt == torch.bfloat16 and Sq > 1:  # lse off (WRITE_LSE=False): the same out
            op, lp = G.gluon_attention_fwd(q, k, v, causal=causal, variant="persistent", num_sms=3, write_lse=False)
            finish_or_die(f"persistent write_lse=False B{B} Sq{Sq} Sk{Sk} causal={causal}")
            res.append(f"persistent/3/no-lse {torch.equal(op, o1) and lp is None}")
        if Hq != Hkv:  # [B, S, H, D] storage (strided descriptors), GQA: against overlap on the same inputs
            qs, ks, vs = _inputs(B, Hq, Hkv, Sq, Sk, D, dt, layout="bshd")
            ob, lb = G.gluon_attention_fwd(qs, ks, vs, causal=causal, variant="overlap")
            op, lp = G.gluon_attention_fwd(qs, ks, vs, causal=causal, variant="persistent", num_sms=3)
            finish_or_die(f"persistent bshd B{B} Hq{Hq} Hkv{Hkv} Sq{Sq} causal={causal}")
            res.append(f"persistent/3/bshd {torch.equal(op, ob) and torch.equal(lp, lb)}")
        good_p = all(r.endswith("True") for r in res)
        ok &= good_p
        line += f" | persistent==ovl bitwise: {', '.join(res)} {'PASS' if good_p else 'FAIL'}"
    if D in G._WG3_HEAD_DIMS and "persistent3" in CHECK:
        # persistent3: 192-row tiles, not overlap's arithmetic order per tile -> the float64 reference, overlap's bound
        res = []
        for n, wl in ((None, True), (3, True), (1, True), (3, False)):
            op, lp = G.gluon_attention_fwd(q, k, v, causal=causal, variant="persistent3", num_sms=n, write_lse=wl)
            finish_or_die(f"persistent3 num_sms={n} B{B} Hq{Hq} Sq{Sq} Sk{Sk} d{D} causal={causal}")
            e3 = (op.double() - ro).abs().max().item()
            g3 = (not torch.isnan(op).any() and e3 <= 2 * e_def + 2e-3
                  and bool((op[empty.unsqueeze(-1).expand_as(op)] == 0).all()))
            if wl:
                g3 = g3 and bool(torch.isposinf(lp[empty]).all()) and (
                    not fin.any() or (lp.double()[fin] - rl[fin]).abs().max().item() < 1e-3)
            else:
                g3 = g3 and lp is None
            res.append(f"persistent3/{n or 'all'}{'' if wl else '/no-lse'} err={e3:.3g} {g3}")
        good3 = all(r.endswith("True") for r in res)
        ok &= good3
        line += f" | persistent3 vs ref: {', '.join(res)} {'PASS' if good3 else 'FAIL'}"
    if D in G._PINGPONG_HEAD_DIMS and "pingpong" in CHECK:
        # pingpong == overlap bit for bit: the named barriers only delay wgmma issues, the arithmetic is overlap's
        op, lp = G.gluon_attention_fwd(q, k, v, causal=causal, variant="pingpong")
        finish_or_die(f"pingpong B{B} Hq{Hq} Sq{Sq} Sk{Sk} d{D} causal={causal}")
        res = [f"pingpong {torch.equal(op, o1) and torch.equal(lp, l1)}"]
        if Sq > 1:
            op, lp = G.gluon_attention_fwd(q, k, v, causal=causal, variant="pingpong", write_lse=False)
            finish_or_die(f"pingpong write_lse=False B{B} Sq{Sq} Sk{Sk} d{D} causal={causal}")
            res.append(f"pingpong/no-lse {torch.equal(op, o1) and lp is None}")
        good_pp = all(r.endswith("True") for r in res)
        ok &= good_pp
        line += f" | pingpong==ovl bitwise: {', '.join(res)} {'PASS' if good_pp else 'FAIL'}"
    print(line, flush=True)
print(f"correctness {'PASS' if ok else 'FAIL'} ({time.time() - T0:.0f} s)", flush=True)

# Timing, most important rows first; a row is skipped once the script has run 140 s (the watchdog is at 170 s).
# Measurements print as they are taken. The S = 512 rows of session 7 are dropped (noisy, and the time is needed
# for the persistent builds). d = 128, S = 4096 non-causal is the row the persistent grid targets (0.96x cuDNN).
rows = ((128, 4, 16, 4096, False), (128, 4, 16, 4096, True), (128, 1, 16, 16384, True), (128, 1, 16, 16384, False),
        (64, 4, 32, 4096, False), (64, 4, 32, 4096, True))
if "persistent3" in CHECK:  # d = 64 at 16k tokens per batch (the rows of the cuDNN comparison), after the others
    rows += ((64, 1, 32, 16384, False), (64, 1, 32, 16384, True))
if os.environ.get("VCHECK_D64_SWEEP") == "1":  # the d = 64 route rule's rows: 16k tokens per batch, S = 1k-16k
    rows = tuple((64, 16384 // S, 32, S, c) for S in (1024, 2048, 4096, 8192, 16384) for c in (False, True))
BUDGET = float(os.environ.get("VCHECK_BUDGET_S", "140"))
for D, B, H, S, causal in rows:
    if time.time() - T0 > BUDGET:
        print(f"d{D} B{B} H{H} S{S} causal={causal}: skipped (time budget)", flush=True)
        continue
    q, k, v = _inputs(B, H, H, S, S, D, torch.bfloat16)
    flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    variants = ["overlap"] + [vr for vr in ("pingpong", "overlap2", "persistent", "persistent_pingpong")
                              if vr in CHECK] + (["persistent3"] if D in G._WG3_HEAD_DIMS and "persistent3" in CHECK
                                                 else []) + (
        ["persistent_lpt"] if causal and D == 128 and "persistent_lpt" in CHECK else []) + [
        f"persistent~p{kk}" for kk in POLY]
    if ROWSUM:  # next to their base variant in the list (timing order is rotated per round anyway)
        variants += ["persistent+rowsum", "persistent+rowsum-nopin"] + (
            ["persistent3+rowsum"] if D in G._WG3_HEAD_DIMS and "persistent3" in CHECK else [])
    for vr in variants:
        _fwd(q, k, v, causal, vr)  # compile + one run under the hang guard
        finish_or_die(f"{vr} d{D} B{B} H{H} S{S} causal={causal}")
    if ROWSUM:  # rowsum builds vs float64 on the first head (not bitwise), overlap's bound
        sl = (slice(0, 1), slice(0, 1))
        ro, rl, empty = reference(q[sl], k[sl], v[sl], causal, 1.0 / math.sqrt(D), torch.float64)
        e_o = (_fwd(q, k, v, causal, "overlap")[0][sl].double() - ro).abs().max().item()
        for vr in [x for x in variants if "+rowsum" in x]:
            o_r, l_r = _fwd(q, k, v, causal, vr)
            e_r = (o_r[sl].double() - ro).abs().max().item()
            e_l = (l_r[sl].double() - rl)[~empty].abs().max().item() if (~empty).any() else 0.0
            good_r = e_r <= 2 * e_o + 2e-3 and e_l < 1e-3 and not torch.isnan(o_r).any()
            ok &= good_r
            print(f"  d{D} S{S} causal={causal} {vr} vs float64 (head 0): err={e_r:.3g} (overlap {e_o:.3g}) "
                  f"lse_err={e_l:.3g} {'PASS' if good_r else 'FAIL'}", flush=True)
    # three rounds, the order rotated each round, the median per variant (a fixed order favoured the first one
    # by up to 10% in session 9's attention table)
    runs = {vr: [] for vr in variants}
    for r in range(3):
        for vr in round_order(variants, r):
            runs[vr].append(triton.testing.do_bench(lambda: _fwd(q, k, v, causal, vr), warmup=30, rep=100))
    t = {vr: sorted(runs[vr])[1] for vr in variants}
    for vr in variants:
        print(f"  d{D} B{B} H{H} S{S} causal={causal} {vr}: {t[vr]:.3f} ms {flops / t[vr] * 1e-9:.0f} TFLOP/s "
              f"(rounds {', '.join(f'{x:.3f}' for x in runs[vr])})", flush=True)
    print(f"d{D} B{B} H{H} S{S} causal={causal}: " + "  ".join(
        f"{vr}/overlap {t['overlap'] / t[vr]:.3f}x" for vr in t if vr != "overlap"), flush=True)
print(f"done ({time.time() - T0:.0f} s){'' if ok else ' (a correctness check FAILED)'}", flush=True)

import sys as _s
_s.stdout.flush()
os._exit(0)
