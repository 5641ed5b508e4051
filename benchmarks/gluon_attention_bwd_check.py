"""GPU check of the Gluon FA3-style backward (``fxopt/kernels/attention_gluon_bwd.py``): correctness, then TFLOP/s.

(a) Correctness on random inputs (randn, never zeros). ``out`` / ``lse`` come from a float64 reference forward
    (cast to the input dtype / fp32), so only the backward is under test; the reference gradients are the exact
    float64 formulas (dV = P^T dO, dS = P * (dP - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q, summed
    over the query heads of a GQA group). Max abs error per gradient, PASS / FAIL with the tolerance of
    tests/test_attention_kernels.py ``_assert_close(..., scale=2)``: bf16 2.5e-2, fp16 3e-3, times 2 and
    max(1, max |ref|). The Triton backward's error on the same inputs is reported next to it (``err_triton``).
    Extra cases: ragged S, causal Sq < Sk (bottom-right) and Sq > Sk (rows with no visible key: lse = +inf, their
    dq must be exactly 0), GQA 4:2 and 8:1, a [B, S, H, D] view, a custom scale, fp16, and refusals.
(b) Backward TFLOP/s at 16k tokens per batch (B * S = 16384), H = 16, d = 128, S in {1024, 4096, 16384}, causal
    and not: gluon backward vs Triton backward (``flash_attention_triton_bwd``) vs cuDNN SDPA backward (time of
    forward + ``torch.autograd.grad`` minus time of the forward, cuDNN backend via ``sdpa_kernel``).
    FLOPs = 10 B H S^2 d (2.5x the forward), halved for causal. Also fwd + bwd totals (gluon fwd + gluon bwd
    vs cuDNN fwd + bwd).

Writes ``gluon_attention_bwd_check.json`` / ``.md`` into ``--out`` after every case. A wrong mbarrier phase
deadlocks the GPU: every case re-arms a ``faulthandler`` watchdog (``--case-timeout``) that dumps the Python stacks
and exits the process; the script ends with ``os._exit``.

    python benchmarks/gluon_attention_bwd_check.py --quick --out $OUT      # about 1-2 minutes
    python benchmarks/gluon_attention_bwd_check.py --out $OUT              # more cases, more timing reps
    python benchmarks/gluon_attention_bwd_check.py --quick --variant 1,2 --out $OUT
        # also checks (case tags ``...@v1``) and times (``gluon_v1_bwd_tflops``) the opt-in variants of
        # ``gluon_attention_bwd(variant=...)`` next to the default kernel (variants at d = 64 and 128)
    python benchmarks/gluon_attention_bwd_check.py --quick --variant 1,3 --out $OUT
        # session 8: variant 3 (dK issued before the dS^T publication) beside variant 1 (what the op routes),
        # with ``v3/v1`` speed ratios and fwd + bwd totals per variant (``gluon_v3_fwdbwd_tflops``)
    python benchmarks/gluon_attention_bwd_check.py --quick --dims 256 --variant 6 --out $OUT
        # session 14: with the d = 256 kernel's dQ-by-TMA build (variant 6) checked and timed beside it
    python benchmarks/gluon_attention_bwd_check.py --quick --dims 256 --out $OUT
        # session 9: only the d = 256 kernel (``_fa3_bwd_kernel_d256``): its correctness cases and its bench rows
        # (S 1024 / 4096 / 16384, causal and not) against the Triton backward and cuDNN

With ``--quick`` the Triton backward is timed WITHOUT autotuning (``FXOPT_ATTN_AUTOTUNE=0``: first config of its
class, set by this script unless ``--triton-autotune 1``), so its column may be slower than the tuned kernel's; the
run's notes say which mode was used.
"""
from __future__ import annotations

import faulthandler
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (arm_watchdog, env_info, markdown_table, parse_args, save_state,  # noqa: E402
                    try_bench_ms)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

NAME = "gluon_attention_bwd_check"
TOL = {torch.bfloat16: 2.5e-2, torch.float16: 3e-3}
GRAD_SCALE = 2.0  # tests/test_attention_kernels.py uses _assert_close(..., scale=2) for gradients
STATE = {"env": None, "args": None, "correctness": [], "bench": [], "notes": []}


def _extra(p):
    p.add_argument("--case-timeout", type=float, default=90.0,
                   help="seconds one case (compile included) may take before the watchdog kills the process")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--triton-ref", type=int, default=None,
                   help="1: also report the Triton backward's error per case (default: on, off with --quick: "
                        "its autotuning per shape bucket costs minutes)")
    p.add_argument("--variant", default="",
                   help="comma list of extra gluon_attention_bwd variants (1, 2, 3) to check and time next to the "
                        "default kernel (default: none, i.e. the default kernel only)")
    p.add_argument("--dims", default="128,64",
                   help="head dims whose correctness cases and bench rows run (128, 64, 256; default 128,64)")
    p.add_argument("--triton-autotune", type=int, default=None,
                   help="1: let the Triton backward autotune (default: on, off with --quick: FXOPT_ATTN_AUTOTUNE=0, "
                        "first config only, to stay within the quick run's time)")


def _dims(args):
    return {int(x) for x in str(getattr(args, "dims", "") or "128,64").split(",") if x.strip()}


def _variants(args):
    return [int(x) for x in str(getattr(args, "variant", "") or "").split(",") if x.strip() and int(x) != 0]


def _arm(seconds: float) -> None:
    arm_watchdog(seconds)


def _save(out_dir: str) -> None:
    save_state(out_dir, NAME, STATE, "Gluon FA3-style backward: correctness and speed",
               [("Correctness (max abs error vs float64)", "correctness"),
                ("Backward TFLOP/s (10 B H S^2 d, halved for causal; ratios gluon / cuDNN, triton / cuDNN)",
                 "bench")])


# ----------------------------------------------------------------------------------------------------------------
# (a) correctness
# ----------------------------------------------------------------------------------------------------------------


def reference(q, k, v, dout, causal, scale, dtype=torch.float64):
    """Exact forward and backward in `dtype`: out, lse (+inf on empty rows), dq, dk, dv, empty-row mask."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qf, kf, vf, dof = q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)
    kr = kf.repeat_interleave(g, dim=1)
    vr = vf.repeat_interleave(g, dim=1)
    s = torch.matmul(qf, kr.transpose(-1, -2)) * scale
    if causal:  # bottom-right aligned: key j visible to query i iff j <= i + Sk - Sq
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    p = torch.where(empty[..., None], torch.zeros_like(p), p)
    out = torch.matmul(p, vr)
    dp = torch.matmul(dof, vr.transpose(-1, -2))
    delta = (dof * out).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf).reshape(B, Hkv, g, Sk, D).sum(2) * scale
    dv = torch.matmul(p.transpose(-1, -2), dof).reshape(B, Hkv, g, Sk, D).sum(2)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    return out, lse, dq, dk, dv, empty


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, layout="bhsd", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(H, S):
        if layout == "bshd":  # [B, S, H, D] storage viewed as [B, H, S, D]
            return torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        return torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g)

    return mk(Hq, Sq), mk(Hkv, Sk), mk(Hkv, Sk), mk(Hq, Sq)


def check_case(GB, tag, B, Hq, Hkv, Sq, Sk, D, dtype, causal, scale=None, layout="bhsd", triton_ref=True,
               variant=0):
    row = dict(case=tag, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, d=D, dtype=str(dtype).replace("torch.", ""),
               causal=causal, layout=layout)
    t0 = time.time()
    try:
        q, k, v, dout = _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, layout)
        sc = scale if scale is not None else 1.0 / math.sqrt(D)
        ro, rl, rdq, rdk, rdv, empty = reference(q, k, v, dout, causal, sc)
        out = ro.to(dtype)
        if layout == "bshd":  # same strides as q (a view), to exercise non-contiguous out / dout
            out = torch.empty_like(q).copy_(out)
        lse = rl.float().contiguous()
        if variant:
            dq, dk, dv = GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                                variant=variant)
        else:
            dq, dk, dv = GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, scale=scale)
        torch.cuda.synchronize()
        nan = any(bool(torch.isnan(t).any()) for t in (dq, dk, dv))
        ok = not nan
        for name, x, ref in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
            err = (x.double() - ref).abs().max().item()
            lim = TOL[dtype] * GRAD_SCALE * max(1.0, ref.abs().max().item())
            row[f"err_{name}"] = err
            row[f"lim_{name}"] = lim
            ok = ok and err <= lim
        empty_ok = True
        if empty.any():  # rows with no visible key: exactly zero dq
            empty_ok = bool((dq[empty.unsqueeze(-1).expand_as(dq)] == 0).all())
            ok = ok and empty_ok
        row.update(empty_rows=int(empty.sum().item()), empty_ok=empty_ok, nan=nan)
        if triton_ref:
            try:
                from fxopt.kernels.attention import flash_attention_triton_bwd
                tq, tk, tv = flash_attention_triton_bwd(dout, q, k, v, out, lse, is_causal=causal, scale=scale)
                row["err_triton"] = max((t.double() - r).abs().max().item()
                                        for t, r in ((tq, rdq), (tk, rdk), (tv, rdv)))
            except Exception as e:
                row["err_triton"] = f"{type(e).__name__}"
        row["status"] = "PASS" if ok else "FAIL"
    except Exception as e:  # one failure must not stop the rest
        row.update(status="ERROR", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        traceback.print_exc()
    row["sec"] = round(time.time() - t0, 2)
    print(f"[check] {tag:30s} {row['status']:5s} " + " ".join(
        f"{n}={row[f'err_{n}']:.2e}/{row[f'lim_{n}']:.1e}" for n in ("dq", "dk", "dv") if f"err_{n}" in row)
        + f" {row.get('error', '')}", flush=True)
    return row


def refuse_case(GB, tag, make):
    """Inputs the wrapper must refuse with ValueError (so a caller can fall back)."""
    row = dict(case=tag)
    try:
        q, k, v, causal = make()
        out, dout = torch.empty_like(q), torch.randn_like(q)
        lse = torch.zeros(q.shape[:3], device=q.device, dtype=torch.float32)
        reason = GB.gluon_bwd_supported(dout, q, k, v, out, lse, causal)
        try:
            GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal)
            row.update(status="FAIL", error=f"no ValueError (gluon_bwd_supported said {reason!r})")
        except ValueError as e:
            row.update(status="PASS" if reason else "FAIL", error=str(e)[:200])
    except Exception as e:
        row.update(status="ERROR", error=f"{type(e).__name__}: {e}"[:300])
    print(f"[check] {tag:30s} {row['status']:5s} {row.get('error', '')}", flush=True)
    return row


def _triton_ref(args) -> bool:
    return bool(args.triton_ref) if args.triton_ref is not None else not args.quick


def run_checks(GB, args):
    bf, fp = torch.bfloat16, torch.float16
    cases = []
    for D in (128, 64):
        for S in (128, 200, 1024):
            for causal in (False, True):
                tag = f"S{S}_d{D}_{'c' if causal else 'nc'}_bf16"
                cases.append((tag, dict(B=2, Hq=2, Hkv=2, Sq=S, Sk=S, D=D, dtype=bf, causal=causal)))
    cases += [
        ("gqa_Hq4_Hkv2_S256_c", dict(B=2, Hq=4, Hkv=2, Sq=256, Sk=256, D=128, dtype=bf, causal=True)),
        ("gqa_Hq8_Hkv1_S333_nc", dict(B=1, Hq=8, Hkv=1, Sq=333, Sk=333, D=128, dtype=bf, causal=False)),
        ("causal_Sq100_Sk300", dict(B=1, Hq=2, Hkv=2, Sq=100, Sk=300, D=128, dtype=bf, causal=True)),
        ("causal_Sq300_Sk100_empty", dict(B=1, Hq=2, Hkv=2, Sq=300, Sk=100, D=128, dtype=bf, causal=True)),
        ("causal_Sq200_Sk520_gqa_d64", dict(B=1, Hq=4, Hkv=2, Sq=200, Sk=520, D=64, dtype=bf, causal=True)),
        ("noncausal_Sq77_Sk333", dict(B=1, Hq=2, Hkv=2, Sq=77, Sk=333, D=128, dtype=bf, causal=False)),
        ("S1024_d128_c_fp16", dict(B=2, Hq=2, Hkv=2, Sq=1024, Sk=1024, D=128, dtype=fp, causal=True)),
        ("S200_d128_nc_fp16", dict(B=2, Hq=2, Hkv=2, Sq=200, Sk=200, D=128, dtype=fp, causal=False)),
        ("bshd_view_d128", dict(B=2, Hq=3, Hkv=3, Sq=384, Sk=384, D=128, dtype=bf, causal=True, layout="bshd")),
        ("scale0.3_d128", dict(B=1, Hq=2, Hkv=2, Sq=256, Sk=256, D=128, dtype=bf, causal=False, scale=0.3)),
        ("Sq1_Sk50", dict(B=2, Hq=2, Hkv=2, Sq=1, Sk=50, D=128, dtype=bf, causal=False)),
    ]
    if not args.quick:
        cases += [("S2048_d128_c_gqa", dict(B=1, Hq=4, Hkv=1, Sq=2048, Sk=2048, D=128, dtype=bf, causal=True)),
                  ("S1500_d64_nc_fp16", dict(B=1, Hq=2, Hkv=2, Sq=1500, Sk=1500, D=64, dtype=fp, causal=False))]
    for S in (128, 200, 1024):  # d = 256 (session 9 kernel): as the d = 128 set, plus its GQA / ragged / fp16 cases
        for causal in (False, True):
            cases.append((f"S{S}_d256_{'c' if causal else 'nc'}_bf16",
                          dict(B=2, Hq=2, Hkv=2, Sq=S, Sk=S, D=256, dtype=bf, causal=causal)))
    cases += [
        ("gqa_Hq4_Hkv2_S256_c_d256", dict(B=2, Hq=4, Hkv=2, Sq=256, Sk=256, D=256, dtype=bf, causal=True)),
        ("gqa_Hq8_Hkv1_S333_nc_d256", dict(B=1, Hq=8, Hkv=1, Sq=333, Sk=333, D=256, dtype=bf, causal=False)),
        ("causal_Sq100_Sk300_d256", dict(B=1, Hq=2, Hkv=2, Sq=100, Sk=300, D=256, dtype=bf, causal=True)),
        ("causal_Sq300_Sk100_empty_d256", dict(B=1, Hq=2, Hkv=2, Sq=300, Sk=100, D=256, dtype=bf, causal=True)),
        ("noncausal_Sq77_Sk333_d256", dict(B=1, Hq=2, Hkv=2, Sq=77, Sk=333, D=256, dtype=bf, causal=False)),
        ("S1024_d256_c_fp16", dict(B=2, Hq=2, Hkv=2, Sq=1024, Sk=1024, D=256, dtype=fp, causal=True)),
        ("bshd_view_d256", dict(B=2, Hq=3, Hkv=3, Sq=384, Sk=384, D=256, dtype=bf, causal=True, layout="bshd")),
        ("Sq1_Sk50_d256", dict(B=2, Hq=2, Hkv=2, Sq=1, Sk=50, D=256, dtype=bf, causal=False)),
    ]
    cases = [(tag, kw) for tag, kw in cases if kw["D"] in _dims(args)]
    for tag, kw in cases:
        _arm(args.case_timeout)
        STATE["correctness"].append(check_case(GB, tag, triton_ref=_triton_ref(args), **kw))
        _save(args.out)
        for var in _variants(args):
            if kw["D"] not in GB._VARIANT_DIMS and not (kw["D"] == 256 and var == GB.DQ_TMA_VARIANT):
                continue  # the variant would run the default kernel (d = 256: variant 6 is its dQ-by-TMA build)
            _arm(args.case_timeout)
            STATE["correctness"].append(check_case(GB, f"{tag}@v{var}", triton_ref=False, variant=var, **kw))
            _save(args.out)

    def noncontig():
        x = torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16)
        return x.transpose(2, 3), x, x, False

    refusals = [
        ("refuse_last_dim_stride", noncontig),
        ("refuse_fp32", lambda: (*(torch.randn(1, 1, 64, 64, device="cuda") for _ in range(3)), False)),
        ("refuse_d96", lambda: (*(torch.randn(1, 1, 64, 96, device="cuda", dtype=torch.bfloat16)
                                  for _ in range(3)), True)),
        ("refuse_cpu", lambda: (*(torch.randn(1, 1, 64, 64, dtype=torch.bfloat16) for _ in range(3)), False)),
    ]
    for tag, make in refusals:
        _arm(args.case_timeout)
        STATE["correctness"].append(refuse_case(GB, tag, make))
        _save(args.out)
    n_bad = sum(r["status"] != "PASS" for r in STATE["correctness"])
    print(f"[check] {len(STATE['correctness']) - n_bad} / {len(STATE['correctness'])} PASS", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# (b) speed
# ----------------------------------------------------------------------------------------------------------------


def _bench(fn, quick):
    return try_bench_ms(fn, quick)


def run_bench(GB, args):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fxopt.kernels.attention import flash_attention_triton, flash_attention_triton_bwd

    try:
        from fxopt.kernels.attention_gluon import gluon_attention_fwd
    except Exception:  # pragma: no cover
        gluon_attention_fwd = None
    rows = [(128, 1024, False), (128, 1024, True), (128, 4096, False), (128, 4096, True), (128, 16384, False),
            (128, 16384, True)]
    if not args.quick:
        rows += [(64, 4096, False), (64, 4096, True)]
    elif _dims(args) == {64}:  # --quick --dims 64 (session 9: split dQ at d = 64): the d = 64 bench rows
        rows += [(64, S, c) for S in (1024, 4096, 16384) for c in (False, True)]
    rows += [(256, S, c) for S in (1024, 4096, 16384) for c in (False, True)]
    rows = [r for r in rows if r[0] in _dims(args)]
    for D, S, causal in rows:
        _arm(args.case_timeout + 120)  # the Triton backward autotunes on its first call
        B, H = 16384 // S, 16
        q, k, v, dout = _inputs(B, H, H, S, S, D, torch.bfloat16)
        flops_bwd = 10.0 * B * H * S * S * D * (0.5 if causal else 1.0)
        flops_fwd = flops_bwd / 2.5
        row = dict(d=D, S=S, B=B, H=H, causal=causal)
        try:
            out, lse = flash_attention_triton(q, k, v, is_causal=causal, return_lse=True)
        except Exception as e:
            row["error"] = f"forward for out / lse failed: {type(e).__name__}"
            STATE["bench"].append(row)
            _save(args.out)
            continue
        row["gluon_bwd_ms"] = _bench(lambda: GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal),
                                     args.quick)
        _save(args.out)
        for var in _variants(args):
            if D in GB._VARIANT_DIMS or (D == 256 and var == GB.DQ_TMA_VARIANT):
                row[f"gluon_v{var}_bwd_ms"] = _bench(
                    lambda: GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, variant=var),
                    args.quick)
                ms = row[f"gluon_v{var}_bwd_ms"]
                row[f"gluon_v{var}_bwd_tflops"] = flops_bwd / (ms * 1e-3) / 1e12 if ms else None
                _save(args.out)
        row["triton_bwd_ms"] = _bench(lambda: flash_attention_triton_bwd(dout, q, k, v, out, lse,
                                                                         is_causal=causal), args.quick)
        _save(args.out)
        # cuDNN: fwd + autograd bwd, minus fwd
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

        def cudnn_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)

        def cudnn_fwdbwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            return torch.autograd.grad(o, (qg, kg, vg), dout)

        f_ms = _bench(cudnn_fwd, args.quick)
        fb_ms = _bench(cudnn_fwdbwd, args.quick)
        row["cudnn_fwd_ms"] = f_ms
        row["cudnn_fwdbwd_ms"] = fb_ms
        row["cudnn_bwd_ms"] = (fb_ms - f_ms) if (f_ms and fb_ms) else None
        if gluon_attention_fwd is not None:
            row["gluon_fwd_ms"] = _bench(lambda: gluon_attention_fwd(q, k, v, causal=causal), args.quick)
        for n in ("gluon", "triton", "cudnn"):
            ms = row.get(f"{n}_bwd_ms")
            row[f"{n}_bwd_tflops"] = flops_bwd / (ms * 1e-3) / 1e12 if ms else None
        tf = {n: row[f"{n}_bwd_tflops"] for n in ("gluon", "triton", "cudnn")}
        row["gluon/cudnn"] = tf["gluon"] / tf["cudnn"] if tf["gluon"] and tf["cudnn"] else None
        row["triton/cudnn"] = tf["triton"] / tf["cudnn"] if tf["triton"] and tf["cudnn"] else None
        if row.get("gluon_fwd_ms") and row["gluon_bwd_ms"] and fb_ms:
            tot = row["gluon_fwd_ms"] + row["gluon_bwd_ms"]
            row["gluon_fwdbwd_tflops"] = (flops_fwd + flops_bwd) / (tot * 1e-3) / 1e12
            row["cudnn_fwdbwd_tflops"] = (flops_fwd + flops_bwd) / (fb_ms * 1e-3) / 1e12
            row["fwdbwd gluon/cudnn"] = row["gluon_fwdbwd_tflops"] / row["cudnn_fwdbwd_tflops"]
        for var in _variants(args):  # per variant: fwd + bwd with the Gluon forward, and speed relative to variant 1
            vms = row.get(f"gluon_v{var}_bwd_ms")
            if vms and row.get("gluon_fwd_ms") and fb_ms:
                row[f"gluon_v{var}_fwdbwd_tflops"] = (flops_fwd + flops_bwd) / ((row["gluon_fwd_ms"] + vms) * 1e-3) / 1e12
                row[f"fwdbwd v{var}/cudnn"] = row[f"gluon_v{var}_fwdbwd_tflops"] / ((flops_fwd + flops_bwd)
                                                                                    / (fb_ms * 1e-3) / 1e12)
            if vms and var != 1 and row.get("gluon_v1_bwd_ms"):
                row[f"v{var}/v1"] = row["gluon_v1_bwd_ms"] / vms  # > 1: faster than variant 1
            if vms and var == 4 and row.get("gluon_v3_bwd_ms"):
                row["v4/v3"] = row["gluon_v3_bwd_ms"] / vms  # > 1: faster than variant 3
        STATE["bench"].append(row)
        for var in _variants(args):
            if row.get(f"gluon_v{var}_bwd_tflops"):
                tf[f"gluon_v{var}"] = row[f"gluon_v{var}_bwd_tflops"]
        print(f"[bench] d={D} S={S} causal={causal}: bwd " + "  ".join(
            f"{n} {tf[n]:.0f}" if tf[n] else f"{n} -" for n in tf) + " TFLOP/s", flush=True)
        _save(args.out)
        del q, k, v, dout, out, lse, qg, kg, vg
        torch.cuda.empty_cache()


def main():
    args = parse_args("Gluon FA3-style attention backward: correctness and TFLOP/s", _extra)
    STATE["args"] = vars(args)
    t_start = time.time()
    _arm(args.case_timeout)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90)")
        return 2
    STATE["env"] = env_info()
    import fxopt.kernels.attention_gluon_bwd as GB

    if GB._GLUON_IMPORT_ERROR:
        STATE["notes"].append(f"gluon unavailable: {GB._GLUON_IMPORT_ERROR}")
        _save(args.out)
        print(STATE["notes"][-1])
        return 1
    STATE["notes"].append(f"configs: { {d: GB.config_for(d) for d in sorted(_dims(args))} }, BLOCK_N {GB.BLOCK_N} "
                          f"(d = 256: {getattr(GB, 'D256_BLOCK_N', '-')}), BLOCK_M {GB.BLOCK_M}")
    bad = [v for v in _variants(args) if v not in GB.VARIANTS]
    if bad:
        print(f"unknown --variant {bad}: this module has {GB.VARIANTS}")
        return 2
    tune = args.triton_autotune if args.triton_autotune is not None else (0 if args.quick else 1)
    if not tune:
        os.environ["FXOPT_ATTN_AUTOTUNE"] = "0"
    STATE["notes"].append("Triton backward timed " + ("WITH autotuning" if tune else
                          "WITHOUT autotuning (FXOPT_ATTN_AUTOTUNE=0: first config of its class; the tuned kernel "
                          "may be faster)") + f"; FXOPT_ATTN_AUTOTUNE={os.environ.get('FXOPT_ATTN_AUTOTUNE', 'unset')}")
    print(STATE["notes"][-1], flush=True)
    if not args.skip_check:
        run_checks(GB, args)
    if not args.skip_bench:
        run_bench(GB, args)
    faulthandler.cancel_dump_traceback_later()
    STATE["notes"].append(f"total {time.time() - t_start:.0f} s")
    _save(args.out)
    print("\n## Correctness\n" + markdown_table(
        [{k: r.get(k) for k in ("case", "status", "err_dq", "err_dk", "err_dv", "lim_dq", "err_triton",
                                "empty_rows", "error")} for r in STATE["correctness"]]))
    cols = ("d", "S", "causal", "gluon_bwd_tflops") + tuple(f"gluon_v{v}_bwd_tflops" for v in _variants(args)) + (
        "triton_bwd_tflops", "cudnn_bwd_tflops", "gluon/cudnn", "triton/cudnn", "fwdbwd gluon/cudnn") + tuple(
        f"v{v}/v1" for v in _variants(args) if v != 1 and 1 in _variants(args)) + tuple(
        f"fwdbwd v{v}/cudnn" for v in _variants(args)) + (("v4/v3",) if {3, 4} <= set(_variants(args)) else ())
    print("## Backward TFLOP/s (bf16, 16k tokens per batch)\n" + markdown_table(
        [{k: r.get(k) for k in cols} for r in STATE["bench"]]))
    print(f"wrote {args.out}/{NAME}.json and .md ({time.time() - t_start:.0f} s)")
    return 0 if all(r["status"] == "PASS" for r in STATE["correctness"]) else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # do not wait on a GPU that may still be stuck in a kernel
