"""GPU check of the persistent Gluon fp8 attention forward (``fp8_attention_gluon.py``, ``persistent=True``).

(a) Bit-identity: out and lse of ``persistent=True`` (num_sms 1 / 3 / all SMs) against the default build
    (permute_k + cast_late) on the same quantized tensors, torch.equal, over GQA / Sq != Sk / causal rows with no
    visible key / fp16 / lse on and off cases, and the ring depths 3 and 5 at d = 128.
(b) TFLOP/s, d = 128, H = 16, B * S = 16384, S in {4096, 16384}, causal and not, the kernel alone (quantization
    excluded): default vs persistent (ring depth ``_PERSISTENT_STAGES``) vs persistent with ``--stages`` (default
    3,5). Each build is timed in ``--rounds`` rounds (default 3) with the build order rotated every round; the
    figure is the median over rounds of ``triton.testing.do_bench``'s median. ``ratio`` = TFLOP/s / default's.

Without CUDA (or not sm_90) it says so and exits with status 2. Writes ``fp8_persistent_check.json`` into ``--out``.

    PYTHONUNBUFFERED=1 python benchmarks/fp8_persistent_check.py --out $OUT      # ~1-2 minutes on an H200
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import round_order  # noqa: E402


def _rand(shape, seed, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


# (B, Hq, Hkv, Sq, Sk, D, dtype, causal, scale, hadamard)
CASES = [
    (2, 8, 2, 300, 333, 128, torch.bfloat16, False, None, True),
    (2, 8, 2, 300, 300, 128, torch.bfloat16, True, None, True),
    (2, 8, 2, 300, 300, 64, torch.bfloat16, True, None, True),
    (2, 4, 2, 260, 300, 128, torch.bfloat16, True, None, True),
    (1, 4, 4, 77, 130, 128, torch.float16, True, 0.1, False),
    (1, 4, 4, 200, 130, 128, torch.float16, True, None, False),
    (1, 2, 1, 1000, 1000, 128, torch.bfloat16, True, None, True),
    (1, 3, 1, 640, 1100, 64, torch.bfloat16, True, None, True),
    (2, 16, 16, 2048, 2048, 128, torch.bfloat16, False, None, True),
    (2, 16, 16, 2048, 2048, 128, torch.bfloat16, True, None, True),
]


def check_identity(G, results):
    ok_all = True
    for case in CASES:
        B, Hq, Hkv, Sq, Sk, D, dtype, causal, scale, had = case
        q = _rand((B, Hq, Sq, D), Sq + D, dtype)
        k = _rand((B, Hkv, Sk, D), Sk + 1, dtype)
        v = _rand((B, Hkv, Sk, D), Sk + 2, dtype)
        qq, qs, kq, ks, vt, vs = G.fp8_gluon_quantize(q, k, v, had, 3)
        kw = dict(shape_q=(B, Hq, Sq, D), seq_k=Sk, n_kv_heads=Hkv, out_dtype=dtype, is_causal=causal, scale=scale)
        ref, ref_lse = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, return_lse=True, **kw)
        variants = [dict(num_sms=n) for n in (1, 3, None)]
        if D == 128:
            variants += [dict(num_sms=3, stages=3), dict(num_sms=None, stages=5)]
        for var in variants:
            try:
                out, lse = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, return_lse=True, persistent=True,
                                                           **var, **kw)
                out2 = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, persistent=True, **var, **kw)
                torch.cuda.synchronize()
                ok = torch.equal(out, ref) and torch.equal(lse, ref_lse) and torch.equal(out2, ref)
                diff = (out.float() - ref.float()).abs().max().item()
                err = None
            except Exception as e:  # report and go on
                ok, diff, err = False, None, f"{type(e).__name__}: {str(e)[:300]}"
            ok_all &= ok
            row = dict(case=f"B{B} H{Hq}/{Hkv} Sq{Sq} Sk{Sk} d{D} {str(dtype)[6:]} causal={causal}", **var,
                       identical=ok, max_abs_diff=diff, error=err)
            results["identity"].append(row)
            print(f"[identity] {'PASS' if ok else 'FAIL'} {row}", flush=True)
    return ok_all


def bench(G, results, rounds, extra_stages):
    import triton.testing

    builds = [("default", {}), ("persistent", dict(persistent=True))]
    builds += [(f"persistent_st{s}", dict(persistent=True, stages=s)) for s in extra_stages]
    D, H = 128, 16
    for S in (4096, 16384):
        B = max(1, 16384 // S)
        for causal in (False, True):
            q, k, v = (_rand((B, H, S, D), 10 + i, torch.bfloat16) for i in range(3))
            qq, qs, kq, ks, vt, vs = G.fp8_gluon_quantize(q, k, v)
            kw = dict(shape_q=(B, H, S, D), seq_k=S, n_kv_heads=H, out_dtype=q.dtype, is_causal=causal)
            fns = {name: (lambda o=opts: G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, **o, **kw))
                   for name, opts in builds}
            for fn in fns.values():  # compile + warm up
                fn()
            torch.cuda.synchronize()
            times = {name: [] for name in fns}
            order = list(fns)
            for r in range(rounds):
                rot = round_order(order, r)
                for name in rot:
                    times[name].append(triton.testing.do_bench(fns[name], warmup=25, rep=100, return_mode="median"))
            flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
            row = dict(S=S, B=B, H=H, D=D, causal=causal)
            for name in fns:
                ms = statistics.median(times[name])
                row[f"{name}_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
                row[f"{name}_ms_rounds"] = [round(t, 4) for t in times[name]]
            for name in fns:
                row[f"{name}_ratio"] = round(row[f"{name}_tflops"] / row["default_tflops"], 4)
            results["bench"].append(row)
            print(f"[bench] S={S} causal={causal}: " + "  ".join(
                f"{n} {row[f'{n}_tflops']} TFLOP/s (x{row[f'{n}_ratio']})" for n in fns), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for fp8_persistent_check.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stages", default="3,5", help="extra persistent ring depths to time at d = 128")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("fp8_persistent_check: needs a CUDA sm_90 GPU (H100 / H200); nothing to do on this machine.")
        sys.exit(2)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fxopt.kernels import fp8_attention_gluon as G

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "identity": [], "bench": []}
    ok = True
    if not args.skip_check:
        ok = check_identity(G, results)
        print(f"[identity] {'ALL PASS' if ok else 'SOME FAILED'}", flush=True)
    if not args.skip_bench:
        bench(G, results, args.rounds, [int(s) for s in args.stages.split(",") if s.strip()])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_persistent_check.json"), "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
