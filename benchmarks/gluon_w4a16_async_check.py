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


def timing():
    """Best default-register config against each async config, 8192 x 8192 (streamed, rotated weights), so the
    speed gain is known in the same call as the correctness result."""
    K = N = 8192
    sets = [(torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device="cuda"),
             (torch.rand(K // G, N, device="cuda") * 0.02 + 0.005).bfloat16(),
             torch.randint(4, 12, (K // G, N), device="cuda").bfloat16()) for _ in range(rotations(K * N // 2))]
    out = []
    for M in (64, 128, 256):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        for kind, cfgs in (("default", KG.gluon_w4a16_configs(M, K, N)), ("async", KG.gluon_w4a16_async_configs(M, K, N))):
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
            print(f"[bench] M={M} best {kind}: {best_t:.1f} us {best}", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="accepted for device_session.sh; the check is the same")
    args = p.parse_args()
    faulthandler.dump_traceback_later(540, exit=True)  # a wrong mbarrier phase would hang
    rows, bad = [], 0
    for K, N in [(1024, 1024), (4096, 11008)]:
        q, s, z = make_packed(K, N)
        w64 = dequantize(q.cpu(), s.cpu(), z.cpu(), G, dtype=torch.float64)
        for M in [16, 64, 128, 256]:
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
            bias = torch.randn(N).bfloat16()
            for cfg in KG.gluon_w4a16_async_configs(M, K, N):
                for b in (None, bias):
                    ref = x.double() @ w64.T + (0 if b is None else b.double())
                    errs = []
                    try:
                        for _ in range(3):
                            y = KG.gluon_w4a16_mm(x.cuda(), q, s, z, G, None if b is None else b.cuda(), **cfg)
                            torch.cuda.synchronize()
                            errs.append(((y.cpu().double() - ref).abs().max() / ref.abs().max()).item())
                        ok, err = max(errs) <= 1.6e-2, max(errs)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        ok, err = False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    bad += not ok
                    rows.append(dict(K=K, N=N, M=M, bias=b is not None, cfg=cfg, ok=ok, err=err))
                    print(f"K={K} N={N} M={M} bias={b is not None} {cfg}: {'PASS' if ok else 'FAIL'} {err}",
                          flush=True)
    print("async check:", "ALL PASS" if bad == 0 else f"{bad} FAIL", flush=True)
    rows += timing()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gluon_w4a16_async_check.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)
    sys.stdout.flush()
    os._exit(0 if bad == 0 else 1)


if __name__ == "__main__":
    main()
