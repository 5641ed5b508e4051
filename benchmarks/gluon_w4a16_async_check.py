"""GPU check of the W4A16 Gluon kernel's asynchronous-wgmma builds (``regs="async"``), which are not tuner
candidates yet: every config of ``gluon_w4a16_async_configs`` against the float64 dequantized reference, with and
without bias, three launches each (a race need not show on every launch).

Session 6 found these builds 8-14% faster but wrong at M = 128 / 256; the offline cause is an epilogue that ptxas
scheduled before the last wgmma's wait (fixed with ``DRAIN_IN_LOOP``, see ``fxopt/kernels/w4a16_gluon.py``). If this
prints ALL PASS on the H200, the async configs can be listed in ``gluon_w4a16_configs``.

``python benchmarks/gluon_w4a16_async_check.py [--out DIR]``
"""
import argparse
import faulthandler
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gluon_w4a16_check import G, make_packed, rotations, streamed_us  # noqa: E402

from fxopt.kernels import w4a16_gluon as KG  # noqa: E402
from fxopt.quant.format import dequantize  # noqa: E402


def check_launches(x, q, s, z, b, ref, cfg, tol, launches=3):
    """(ok, worst relative error or the exception's first line) of ``launches`` runs of one config against ``ref``
    (a race need not show on every launch)."""
    errs = []
    try:
        for _ in range(launches):
            y = KG.gluon_w4a16_mm(x.cuda(), q, s, z, G, None if b is None else b.cuda(), **cfg)
            torch.cuda.synchronize()
            errs.append(((y.cpu().double() - ref).abs().max() / ref.abs().max()).item())
        return max(errs) <= tol, max(errs)
    except Exception as e:  # noqa: BLE001 - report and go on
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def timing(shapes=((8192, 8192),), ms=(64, 128, 256), with_op=False):
    """Best default-register config against the best async config (streamed, rotated weights), so the speed gain
    is known in the same call as the correctness result. ``with_op``: also the op (the tuner's pick) and bf16."""
    out = []
    for K, N in shapes:
        out += _timing_shape(K, N, ms, with_op)
    return out


def _timing_shape(K, N, ms, with_op):
    import torch.nn.functional as F

    import fxopt.kernels.w4a16 as K4

    sets = [(torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device="cuda"),
             (torch.rand(K // G, N, device="cuda") * 0.02 + 0.005).bfloat16(),
             torch.randint(4, 12, (K // G, N), device="cuda").bfloat16()) for _ in range(rotations(K * N // 2))]
    out = []
    for M in ms:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        if with_op:
            bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(rotations(K * N * 2))]
            cfg = K4.choose_config(x, *sets[0], G)
            t_op = streamed_us(lambda it: torch.ops.fxopt.w4a16_linear(x, *it, G), sets)
            t_bf = streamed_us(lambda w: F.linear(x, w), bf)
            del bf
            out.append(dict(timing=True, M=M, K=K, N=N, kind="op", us=t_op, cfg=cfg.label(), bf16_us=t_bf))
            print(f"[bench] K={K} N={N} M={M} op {t_op:.1f} us ({cfg.label()}), bf16 {t_bf:.1f} us", flush=True)
        cands = {"default": KG.gluon_w4a16_configs(max(M, 16), K, N),
                 "async": KG.gluon_w4a16_async_configs(max(M, 16), K, N)}
        for kind, cfgs in cands.items():
            best, best_t = None, float("inf")
            for cfg in cfgs:
                try:
                    t = streamed_us(lambda it: KG.gluon_w4a16_mm(x, *it, G, check_zeros=False, **cfg), sets)
                except Exception as e:  # noqa: BLE001
                    print(f"  {kind} {cfg} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                print(f"  M={M} {kind} {cfg}: {t:.1f} us", flush=True)
                if t < best_t:
                    best, best_t = cfg, t
            out.append(dict(timing=True, M=M, K=K, N=N, kind=kind, us=best_t, cfg=best))
            print(f"[bench] K={K} N={N} M={M} best {kind}: {best_t:.1f} us {best}", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="accepted for device_session.sh; the check is the same")
    p.add_argument("--time-only", action="store_true", help="skip the correctness check")
    p.add_argument("--shapes", default="8192x8192", help="timing shapes KxN, comma-separated")
    p.add_argument("--ms", default="64,128,256", help="timing M values")
    p.add_argument("--with-op", action="store_true", help="also time the op (tuner pick) and bf16 F.linear")
    args = p.parse_args()
    faulthandler.dump_traceback_later(540, exit=True)  # a wrong mbarrier phase would hang
    rows, bad = [], 0
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    if args.time_only:
        rows = timing(shapes, ms, args.with_op)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gluon_w4a16_async_timing.json"), "w") as f:
                json.dump(rows, f, indent=1, default=str)
        sys.stdout.flush()
        os._exit(0)
    for K, N in [(1024, 1024), (4096, 11008)]:
        q, s, z = make_packed(K, N)
        w64 = dequantize(q.cpu(), s.cpu(), z.cpu(), G, dtype=torch.float64)
        for M in [16, 64, 128, 256]:
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
            bias = torch.randn(N).bfloat16()
            for cfg in KG.gluon_w4a16_async_configs(M, K, N):
                for b in (None, bias):
                    ref = x.double() @ w64.T + (0 if b is None else b.double())
                    ok, err = check_launches(x, q, s, z, b, ref, cfg, 1.6e-2)
                    bad += not ok
                    rows.append(dict(K=K, N=N, M=M, bias=b is not None, cfg=cfg, ok=ok, err=err))
                    print(f"K={K} N={N} M={M} bias={b is not None} {cfg}: {'PASS' if ok else 'FAIL'} {err}",
                          flush=True)
    print("async check:", "ALL PASS" if bad == 0 else f"{bad} FAIL", flush=True)
    rows += timing(shapes, ms, args.with_op)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gluon_w4a16_async_check.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)
    sys.stdout.flush()
    os._exit(0 if bad == 0 else 1)


if __name__ == "__main__":
    main()
