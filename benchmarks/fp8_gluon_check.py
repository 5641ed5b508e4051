"""GPU check of the Gluon FP8 forward (``fxopt/kernels/fp8_attention_gluon.py``): correctness, accuracy, TFLOP/s.

(a) Same-input agreement: q, k, v are quantized ONCE with fp8_attention.py's ``quantize_blocks`` (Hadamard +
    e4m3 block scales, V transposed) and both the Triton fp8 kernel (``fp8_attention_quantized``) and the Gluon
    kernel (``fp8_gluon_attention_quantized``) run on those tensors. The math is the same (same scales, P * 2^8 in
    e4m3, same online-softmax blocks of 128 keys), so the outputs should agree to a few bf16 ulps; P rounding can
    flip where the fp32 scores differ in the last bit, hence a loose limit (max abs diff <= 2e-2 * max(1, max|o|)
    and RMS diff <= 2e-3). Six builds of the Gluon kernel (``VARIANTS``): plain K load or ``permute_k``, each
    with and without ``cast_late`` (session 7: P carried in fp32 and cast right before the PV wgmma; the arithmetic
    is the same, so ``same_as_default_*`` reports whether its output is bit-identical to the build without it), and
    ``cast_late`` (+ ``permute_k``) with ``overlap`` (session 7: FA3's order, O rescaled before the next PV issue,
    PV wait pinned below the exp2s; same arithmetic, ``same_as_no_overlap_*`` reports bit-identity with the build
    without it), and permute_k + cast_late with ``pingpong`` (session 8: explicit warpgroup ping-pong, the two
    consumer warpgroups take turns issuing their GEMMs; same arithmetic, so its output and lse MUST be bit-identical
    to the permute_k + cast_late build: ``same_as_nopingpong_permk_castlate``, part of the case's PASS).
    ``--quick`` runs only ``QUICK_VARIANTS`` (plain, permute_k + cast_late (the default) with and without pingpong)
    unless ``--all-builds`` is given, in the checks and in the timing (to stay near 200 s on an H200). Cases:
    ragged S, causal (Sq = Sk, Sq < Sk, Sq > Sk with rows that see no key), GQA, d = 64, fp16, a custom scale, lse.
    lse check: the kernel's lse is compared (max abs error < ``LSE_TOL``) with the float64 logsumexp of the
    DEQUANTIZED scores, (qq * qs)(kq * ks)^T * scale (Hadamard-transformed Q and K: M M^T = I), i.e. the scores the
    kernel actually sees. The error against the unquantized float64 scores (``lse_f64_err*``, reported only) is
    dominated by the e4m3 quantization of Q and K (0.41 at scale 0.3, 0.05 causal on the H200, session 7) and is
    not a kernel check.
(b) Accuracy: RMSE against float64 attention (``fp8_attention.attention_float64``) on FA3's outlier inputs
    N(0, 1) + N(0, 100) * Bernoulli(0.001) and on N(0, 1), B=1 H=4 S=2048 d=128 (as benchmarks/fp8_accuracy.py),
    for the Gluon kernel, the Triton fp8 op and bf16 SDPA. Hadamard on (and off for the outliers row).
(c) TFLOP/s, 16k tokens per batch (B * S = 16384), H = 16, d = 128, S in {4096, 16384} (quick) or
    {1024, 4096, 8192, 16384}, causal and not: Gluon fp8 kernel alone (quantization excluded), Gluon fp8 with
    quantization (``fp8_gluon_attention``), the Triton fp8 kernel alone and the op ``torch.ops.fxopt.fp8_attention``
    (quantization included), the Gluon bf16 forward and cuDNN bf16 SDPA (``--quick``: only the ``QUICK_VARIANTS``
    Gluon fp8 builds, the Triton fp8 kernel and cuDNN). FLOPs = 4 B H S^2 d, halved for causal.

Writes ``fp8_gluon_check.json`` / ``.md`` into ``--out`` after every case; each case re-arms a ``faulthandler``
watchdog (a wrong mbarrier phase or a bad TMA descriptor hangs the GPU) that dumps the stacks and exits.

    python benchmarks/fp8_gluon_check.py --quick --bench-first --case-timeout 90 --out $OUT   # ~3 minutes
    python benchmarks/fp8_gluon_check.py --out $OUT              # full grid
"""
from __future__ import annotations

import faulthandler
import math
import os
import sys
import time
import traceback
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (arm_watchdog, env_info, markdown_table, parse_args, save_state,  # noqa: E402
                    try_bench_ms)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

NAME = "fp8_gluon_check"
# (column suffix, permute_k, cast_late, overlap, pingpong): the Gluon builds checked and timed. A pingpong build
# must follow the build without it (its bit-identity reference).
VARIANTS = (("", False, False, False, False), ("_permk", True, False, False, False),
            ("_castlate", False, True, False, False), ("_permk_castlate", True, True, False, False),
            ("_castlate_overlap", False, True, True, False), ("_permk_castlate_overlap", True, True, True, False),
            ("_permk_castlate_pingpong", True, True, False, True))
# --quick (without --all-builds): the plain build, the default (permute_k + cast_late) and its pingpong variant
# (session 8: replaces permute_k + cast_late + overlap, 5-10% slower than the default on the H200)
QUICK_VARIANTS = ("", "_permk_castlate", "_permk_castlate_pingpong")
LSE_TOL = 1e-2  # vs the float64 lse of the dequantized scores (fp8 products are exact; fp32 / wgmma accumulation)
STATE = {"env": None, "args": None, "agreement": [], "accuracy": [], "bench": [], "notes": []}


def _extra(p):
    p.add_argument("--case-timeout", type=float, default=90.0,
                   help="seconds one case (compile included) may take before the watchdog kills the process")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--bench-first", action="store_true",
                   help="time before checking (the checks' last cases once outran a device call's limit)")
    p.add_argument("--all-builds", action="store_true",
                   help="with --quick: check and time all VARIANTS, not only QUICK_VARIANTS")


def _variants(args):
    if args.quick and not getattr(args, "all_builds", False):
        return tuple(v for v in VARIANTS if v[0] in QUICK_VARIANTS)
    return VARIANTS


def _arm(seconds: float) -> None:
    arm_watchdog(seconds)


def _save(out_dir: str) -> None:
    save_state(out_dir, NAME, STATE, "Gluon FP8 attention forward: agreement, accuracy, speed",
               [("(a) Gluon fp8 vs Triton fp8 kernel on the same quantized inputs", "agreement"),
                ("(b) RMSE vs float64 (B=1, H=4, S=2048, d=128)", "accuracy"),
                ("(c) Forward TFLOP/s (16k tokens per batch, H=16, d=128)", "bench")])


def _rms(a, b):
    return math.sqrt(((a.double() - b.double()) ** 2).mean().item())


# ----------------------------------------------------------------------------------------------------------------
# (a) agreement with the Triton fp8 kernel on the same quantized tensors
# ----------------------------------------------------------------------------------------------------------------


def agreement_case(G, FA, tag, B, Hq, Hkv, Sq, Sk, D, dtype, causal, scale=None, lse=False, variants=VARIANTS):
    row = dict(case=tag, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, d=D, dtype=str(dtype).replace("torch.", ""),
               causal=causal)
    t0 = time.time()
    try:
        g = torch.Generator(device="cuda").manual_seed(zlib.crc32(tag.encode()))
        q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, generator=g)
        qq, qs, kq, ks, vt, vs = G.fp8_gluon_quantize(q, k, v, hadamard=True, seed=0)
        kw = dict(shape_q=(B, Hq, Sq, D), seq_k=Sk, n_kv_heads=Hkv, out_dtype=dtype, is_causal=causal, scale=scale)
        ref = FA.fp8_attention_quantized(qq, qs, kq, ks, vt, vs, **kw)
        f64 = FA.attention_float64(q, k, v, causal, scale)
        lim = 2e-2 * max(1.0, ref.abs().max().item())
        status = "PASS"
        lref = lref_f64 = None
        if lse:
            lref, lref_f64 = _lse_refs(q, k, qq, qs, kq, ks, Hq, Hkv, Sq, Sk, D, causal, scale)
        outs = {}
        lses = {}
        for sfx, pk, cl, ov, pp in variants:
            res = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, return_lse=lse, permute_k=pk,
                                                  cast_late=cl, overlap=ov, pingpong=pp, **kw)
            torch.cuda.synchronize()
            out = res[0] if lse else res
            outs[sfx] = out.clone()
            if lse:
                lses[sfx] = res[1].clone()
            # same arithmetic as the build without cast_late / overlap: expect bit-identical outputs (reported)
            base = sfx.replace("_castlate", "") if cl and not ov else sfx.replace("_overlap", "")
            pp_same = True
            if pp:  # pingpong only reorders GEMM issues between warpgroups: bit-identity is REQUIRED
                base = sfx.replace("_pingpong", "")
                if base in outs:
                    pp_same = bool(torch.equal(outs[sfx], outs[base]))
                    if lse:
                        pp_same = pp_same and bool(torch.equal(lses[sfx], lses[base]))
                    row[f"same_as_nopingpong{base}"] = pp_same
            elif (cl or ov) and base in outs:
                key = f"same_as_no_overlap{sfx.replace('_overlap', '')}" if ov else f"same_as_default{sfx}"
                same = bool(torch.equal(outs[sfx], outs[base]))
                if lse:
                    same = same and bool(torch.equal(lses[sfx], lses[base]))
                row[key] = same
            nan = bool(torch.isnan(out).any())
            d_max = (out.float() - ref.float()).abs().max().item()
            d_rms = _rms(out, ref)
            row[f"maxdiff{sfx}"] = d_max
            row[f"rmsdiff{sfx}"] = d_rms
            row[f"rmse64{sfx}"] = _rms(out, f64)
            ok = (not nan) and d_max <= lim and d_rms <= 2e-3 and pp_same
            if lse:
                # natural-log lse; rows without a visible key give +inf
                fin = torch.isfinite(lref)
                lerr = (res[1].double()[fin] - lref[fin]).abs().max().item() if fin.any() else 0.0
                row[f"lse_err{sfx}"] = lerr
                row[f"lse_f64_err{sfx}"] = ((res[1].double()[fin] - lref_f64[fin]).abs().max().item()
                                            if fin.any() else 0.0)
                ok = ok and lerr < LSE_TOL and bool(torch.isinf(res[1][~fin]).all())
            if not ok:
                status = "FAIL"
        row["rmse64_triton"] = _rms(ref, f64)
        row["lim"] = lim
        row["status"] = status
    except Exception as e:  # report and go on
        row["status"] = "ERROR"
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    row["sec"] = round(time.time() - t0, 2)
    return row


def _dequant(xq, xs, rows):
    """float64 x ~ xq * s from quantize_blocks' [B, H, S_pad, D] codes and [B * H, S_pad / QBLOCK] scales."""
    B, H, S_pad, D = xq.shape
    nb = xs.shape[1]
    x = xq.double().view(B, H, nb, S_pad // nb, D) * xs.double().view(B, H, nb, 1, 1)
    return x.view(B, H, S_pad, D)[:, :, :rows]


def _lse_refs(q, k, qq, qs, kq, ks, Hq, Hkv, Sq, Sk, D, causal, scale):
    """(lse of the dequantized scores, lse of the unquantized scores), float64, natural log, -inf rows kept."""
    sc = scale or 1.0 / math.sqrt(D)
    i = torch.arange(Sq, device=q.device)[:, None]
    j = torch.arange(Sk, device=q.device)[None, :]
    out = []
    for qx, kx in ((_dequant(qq, qs, Sq), _dequant(kq, ks, Sk)), (q.double(), k.double())):
        s = (qx @ kx.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2)) * sc
        if causal:
            s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
        out.append(torch.logsumexp(s, -1))
    return out[0], out[1]


def refuse_case(G, tag, fn):
    try:
        fn()
        return dict(case=tag, status="FAIL", error="no ValueError")
    except ValueError as e:
        return dict(case=tag, status="PASS", error=str(e)[:160])
    except Exception as e:
        return dict(case=tag, status="FAIL", error=f"{type(e).__name__}: {str(e)[:160]}")


def run_agreement(G, FA, args):
    bf, fp = torch.bfloat16, torch.float16
    cases = [
        ("S256_d128_nc", 2, 2, 2, 256, 256, 128, bf, False),
        ("S256_d128_c", 2, 2, 2, 256, 256, 128, bf, True),
        ("S1000_d128_nc", 1, 2, 2, 1000, 1000, 128, bf, False),
        ("S1000_d128_c", 1, 2, 2, 1000, 1000, 128, bf, True),
        ("S200_d64_nc", 2, 2, 2, 200, 200, 64, bf, False),
        ("S1024_d64_c", 1, 2, 2, 1024, 1024, 64, bf, True),
        ("fp16_S512_c", 1, 2, 2, 512, 512, 128, fp, True),
        ("gqa_Hq4_Hkv2", 1, 4, 2, 384, 384, 128, bf, True),
        ("causal_Sq100_Sk300", 1, 2, 2, 100, 300, 128, bf, True),
        ("causal_Sq300_Sk100_empty", 1, 2, 2, 300, 100, 128, bf, True),
        ("Sq1_Sk50", 2, 2, 2, 1, 50, 128, bf, False),
    ]
    if not args.quick:
        cases += [("S4096_d128_c", 1, 4, 4, 4096, 4096, 128, bf, True),
                  ("S2048_d64_nc", 1, 4, 4, 2048, 2048, 64, bf, False)]
    for c in cases:
        _arm(args.case_timeout)
        r = agreement_case(G, FA, *c, variants=_variants(args))
        STATE["agreement"].append(r)
        print(f"[agree] {r['case']}: {r['status']} maxdiff " + " / ".join(
            f"{sfx or 'plain'} {r.get('maxdiff' + sfx)}" for sfx, *_ in _variants(args)) + f" {r.get('error', '')}",
            flush=True)
        _save(args.out)
    for tag, kw in (("scale0.3_lse", dict(scale=0.3, lse=True)), ("lse_causal", dict(lse=True))):
        _arm(args.case_timeout)
        r = agreement_case(G, FA, tag, 1, 2, 2, 300, 300, 128, bf, tag == "lse_causal", variants=_variants(args),
                           **kw)
        STATE["agreement"].append(r)
        print(f"[agree] {tag}: {r['status']} lse_err " + " / ".join(
            f"{sfx or 'plain'} {r.get('lse_err' + sfx)}" for sfx, *_ in _variants(args)) + f" {r.get('error', '')}",
            flush=True)
        _save(args.out)
    mk = lambda *s, **kw: torch.randn(*s, device="cuda", dtype=kw.get("dtype", torch.bfloat16))  # noqa: E731
    for tag, fn in (
        ("refuse_d96", lambda: G.fp8_gluon_attention(mk(1, 1, 64, 96), mk(1, 1, 64, 96), mk(1, 1, 64, 96))),
        ("refuse_d256", lambda: G.fp8_gluon_attention(mk(1, 1, 64, 256), mk(1, 1, 64, 256), mk(1, 1, 64, 256))),
        ("refuse_fp32", lambda: G.fp8_gluon_attention(*(mk(1, 1, 64, 128, dtype=torch.float32),) * 3)),
        ("refuse_cpu", lambda: G.fp8_gluon_attention(*(torch.randn(1, 1, 64, 128, dtype=torch.bfloat16),) * 3)),
    ):
        _arm(args.case_timeout)
        STATE["agreement"].append(refuse_case(G, tag, fn))
        _save(args.out)


# ----------------------------------------------------------------------------------------------------------------
# (b) accuracy vs float64 (FA3's outlier test)
# ----------------------------------------------------------------------------------------------------------------


def make_inputs(kind, shape, gen):
    x = torch.randn(shape, generator=gen)
    if kind == "outliers":
        x = x + torch.randn(shape, generator=gen) * 10.0 * (torch.rand(shape, generator=gen) < 0.001)
    return x.to(torch.bfloat16).cuda()


def run_accuracy(G, FA, args):
    shape = (1, 4, 2048, 128)
    for kind in ("outliers", "normal"):
        for causal in (False, True):
            _arm(args.case_timeout)
            row = dict(inputs=kind, causal=causal)
            try:
                gen = torch.Generator().manual_seed(0)
                q, k, v = (make_inputs(kind, shape, gen) for _ in range(3))
                ref = FA.attention_float64(q, k, v, causal)
                row["bf16 sdpa"] = _rms(F.scaled_dot_product_attention(q, k, v, is_causal=causal), ref)
                row["triton fp8 op (block+Had)"] = _rms(torch.ops.fxopt.fp8_attention(q, k, v, causal, None, True, 0),
                                                        ref)
                for sfx, pk, cl, ov, pp in _variants(args):
                    row[f"gluon fp8{sfx.replace('_', ' ')} (block+Had)"] = _rms(
                        G.fp8_gluon_attention(q, k, v, causal, permute_k=pk, cast_late=cl, overlap=ov, pingpong=pp),
                        ref)
                row["gluon fp8 (block, no Had)"] = _rms(G.fp8_gluon_attention(q, k, v, causal, hadamard=False), ref)
                row["cpu emulation (block+Had)"] = _rms(
                    FA.fp8_attention_reference(q.cpu(), k.cpu(), v.cpu(), causal), ref.cpu())
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
            STATE["accuracy"].append(row)
            print(f"[accuracy] {row}", flush=True)
            _save(args.out)


# ----------------------------------------------------------------------------------------------------------------
# (c) speed
# ----------------------------------------------------------------------------------------------------------------


def _bench(fn, quick):
    return try_bench_ms(fn, quick, width=200)


def run_bench(G, FA, args):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fxopt.kernels.attention_gluon as GB

    seqs = (4096, 16384) if args.quick else (1024, 4096, 8192, 16384)
    D, H = 128, 16
    for S in seqs:
        for causal in (False, True):
            _arm(args.case_timeout + 90)
            B = 16384 // S
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            qq, qs, kq, ks, vt, vs = G.fp8_gluon_quantize(q, k, v)
            kw = dict(shape_q=(B, H, S, D), seq_k=S, n_kv_heads=H, out_dtype=q.dtype, is_causal=causal)
            out = torch.empty_like(q)
            flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            def gluon(pk, cl, ov, pp):
                return lambda: G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, out=out, permute_k=pk,
                                                               cast_late=cl, overlap=ov, pingpong=pp, **kw)

            variants = _variants(args)
            gluon_names = [f"gluon_fp8{sfx}_kernel" for sfx, *_ in variants]
            impls = {name: gluon(pk, cl, ov, pp) for name, (_, pk, cl, ov, pp) in zip(gluon_names, variants)}
            if variants == VARIANTS:  # quick mode (QUICK_VARIANTS) times only the Triton fp8 kernel and cuDNN besides
                impls["gluon_fp8_with_quant"] = lambda: G.fp8_gluon_attention(q, k, v, causal, out=out)
            impls["triton_fp8_kernel"] = lambda: FA.fp8_attention_quantized(qq, qs, kq, ks, vt, vs, out=out, **kw)
            if variants == VARIANTS:
                impls["triton_fp8_op"] = lambda: torch.ops.fxopt.fp8_attention(q, k, v, causal, None, True, 0)
                impls["gluon_bf16"] = lambda: GB.gluon_attention_fwd(q, k, v, causal=causal)
            impls["cudnn_bf16"] = cudnn
            row = dict(d=D, S=S, B=B, H=H, causal=causal)
            for name, fn in impls.items():
                ms = _bench(fn, args.quick)
                row[f"{name}_ms"] = ms
                row[f"{name}_tflops"] = (flops / (ms * 1e-3) / 1e12) if ms else None
            tf = {n: row[f"{n}_tflops"] for n in impls}
            best = max([tf[n] for n in gluon_names if tf[n]] or [0.0])
            row["gluon_fp8_best"] = max(gluon_names, key=lambda n: tf[n] or 0.0) if best else None
            pc, pco = tf.get("gluon_fp8_permk_castlate_kernel"), tf.get("gluon_fp8_permk_castlate_overlap_kernel")
            row["overlap_gain_permk_castlate"] = pco / pc if pc and pco else None
            pcp = tf.get("gluon_fp8_permk_castlate_pingpong_kernel")
            row["pingpong_gain_permk_castlate"] = pcp / pc if pc and pcp else None
            row["gluon_fp8_best/cudnn"] = best / tf["cudnn_bf16"] if best and tf["cudnn_bf16"] else None
            row["triton_fp8/cudnn"] = (tf["triton_fp8_kernel"] / tf["cudnn_bf16"]
                                       if tf["triton_fp8_kernel"] and tf["cudnn_bf16"] else None)
            row["target_1000"] = bool(best >= 1000.0)
            STATE["bench"].append(row)
            print(f"[bench] S={S} causal={causal}: " + "  ".join(
                f"{n} {tf[n]:.0f}" if tf[n] else f"{n} -" for n in impls) + " TFLOP/s", flush=True)
            _save(args.out)
            del q, k, v, qq, kq, vt, out
            torch.cuda.empty_cache()


def main():
    args = parse_args("Gluon FP8 attention forward: agreement, accuracy, TFLOP/s", _extra)
    STATE["args"] = vars(args)
    t_start = time.time()
    _arm(args.case_timeout)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90)")
        return 2
    STATE["env"] = env_info()
    import fxopt.kernels.fp8_attention as FA
    import fxopt.kernels.fp8_attention_gluon as G

    if G._GLUON_IMPORT_ERROR:
        STATE["notes"].append(f"gluon unavailable: {G._GLUON_IMPORT_ERROR}")
        _save(args.out)
        return 1
    STATE["notes"].append(f"configs: { {d: G.config_for(d) for d in (64, 128)} }, "
                          f"PERMUTE_K_DEFAULT={G.PERMUTE_K_DEFAULT}, CAST_LATE_DEFAULT={G.CAST_LATE_DEFAULT}, "
                          f"OVERLAP_DEFAULT={G.OVERLAP_DEFAULT}, PINGPONG_DEFAULT={G.PINGPONG_DEFAULT}, "
                          f"lse tolerance {LSE_TOL} vs the dequantized-score float64 lse")
    STATE["notes"].append("Gluon fp8 builds checked and timed: " + ", ".join(
        f"{sfx or 'default'}" for sfx, *_ in _variants(args)) + (
        " (quick mode: QUICK_VARIANTS only; timing also only the Triton fp8 kernel and cuDNN; --all-builds for all)"
        if _variants(args) != VARIANTS else ""))
    if args.bench_first and not args.skip_bench:
        run_bench(G, FA, args)
    if not args.skip_check:
        run_accuracy(G, FA, args)
        run_agreement(G, FA, args)
    if not args.bench_first and not args.skip_bench:
        run_bench(G, FA, args)
    faulthandler.cancel_dump_traceback_later()
    STATE["notes"].append(f"total {time.time() - t_start:.0f} s")
    _save(args.out)
    print("\n" + markdown_table([{k: r.get(k) for k in ("case", "status", "maxdiff", "maxdiff_permk",
                                                        "maxdiff_castlate", "maxdiff_permk_castlate",
                                                        "maxdiff_permk_castlate_overlap",
                                                        "maxdiff_permk_castlate_pingpong",
                                                        "same_as_default_castlate", "same_as_default_permk_castlate",
                                                        "same_as_no_overlap_castlate",
                                                        "same_as_no_overlap_permk_castlate",
                                                        "same_as_nopingpong_permk_castlate",
                                                        "lse_err", "lse_err_permk_castlate",
                                                        "lse_err_permk_castlate_overlap",
                                                        "lse_err_permk_castlate_pingpong", "rmse64", "rmse64_triton",
                                                        "error")} for r in STATE["agreement"]]))
    print(markdown_table(STATE["accuracy"]))
    print(markdown_table([{k: r.get(k) for k in ("S", "causal", "gluon_fp8_kernel_tflops",
                                                 "gluon_fp8_permk_kernel_tflops", "gluon_fp8_castlate_kernel_tflops",
                                                 "gluon_fp8_permk_castlate_kernel_tflops",
                                                 "gluon_fp8_castlate_overlap_kernel_tflops",
                                                 "gluon_fp8_permk_castlate_overlap_kernel_tflops",
                                                 "gluon_fp8_permk_castlate_pingpong_kernel_tflops",
                                                 "gluon_fp8_with_quant_tflops", "triton_fp8_kernel_tflops",
                                                 "triton_fp8_op_tflops", "gluon_bf16_tflops", "cudnn_bf16_tflops",
                                                 "gluon_fp8_best", "gluon_fp8_best/cudnn",
                                                 "overlap_gain_permk_castlate", "pingpong_gain_permk_castlate")}
                          for r in STATE["bench"]]))
    print(f"wrote {args.out}/{NAME}.json and .md ({time.time() - t_start:.0f} s)")
    return 0 if all(r.get("status") == "PASS" for r in STATE["agreement"]) else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
