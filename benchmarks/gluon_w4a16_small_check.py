"""GPU check of the W4A16 Gluon kernel's opt-in small-M variant (``gluon_w4a16_small_configs``: ``deq="group"`` /
``"xsum"``, ``pdl=True``) and stream-K schedule (``gluon_w4a16_streamk_configs``: ``schedule="streamk"``), both
compiled offline only (session 7) and NOT tuner candidates.

(a) correctness: every candidate of ``gluon_w4a16_small_configs`` (plus ``split_k=1`` copies of the BN 256 ones, so
    the non-split epilogue is covered too) against the float64 dequantized reference, K x N in {1024 x 1024,
    4096 x 11008}, M in {1, 3, 16} (M 3 on 1024 x 1024 only), with and without bias, three launches each (a race
    need not show on every launch); PASS if max |y - ref| / max |ref| <= 1.6e-2 (the bf16 tolerance of the other
    checks). Also fp16 on 1024 x 1024 (M 1 / 16, informational: the op routes bf16 only).
(b) stream-K correctness, the same way: every candidate of ``gluon_w4a16_streamk_configs`` on K x N in
    {1024 x 3072 (96 units on 96 CTAs: 8 CTAs per tile), 4096 x 11008 (1376 units on 132 CTAs: 10-11 each, tiles
    not divided evenly)} x M {1, 16} x bias on / off, plus ``num_sms=7`` (ranges of several whole tiles: direct
    stores, many segments per CTA, the ring running across them) for the BN 256 candidates on 4096 x 11008, M 16,
    and the default register split (``regs`` None) there once.
(c) timing (streamed CUDA graphs on rotated weight copies, as ``benchmarks/gluon_w4a16_async_check.py``): at M in
    {1, 16} on 8192 x 8192 and 8192 x 28672, bf16 ``F.linear``, the best existing Gluon config (session 7), each
    stream-K candidate, each small-M candidate, and the op ``torch.ops.fxopt.w4a16_linear`` (tuner pick; tuned
    last, it may compile many configs).
A watchdog dumps the stacks and exits if anything hangs (a wrong mbarrier phase deadlocks the GPU); every phase
also stops at its own deadline, so the whole run stays under ~150 s.

    python benchmarks/gluon_w4a16_small_check.py --out DIR
"""
import argparse
import faulthandler
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's fxopt (an installed copy may be older)
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gluon_w4a16_async_check import check_launches  # noqa: E402
from gluon_w4a16_check import G, make_packed, rotations, streamed_us  # noqa: E402

from fxopt.kernels import w4a16_gluon as KG  # noqa: E402
from fxopt.quant.format import dequantize  # noqa: E402

CHECK_SHAPES = [(1024, 1024), (4096, 11008)]
CHECK_MS = [1, 3, 16]  # M 3 on the first shape only (time)
SK_CHECK_SHAPES = [(1024, 3072), (4096, 11008)]
SK_CHECK_MS = [1, 16]
TIME_SHAPES = [(8192, 8192), (8192, 28672)]
TIME_MS = [1, 16]
TOL = 1.6e-2
# best existing Gluon config per (K, N, M), session 7 (benchmarks/results/gluon/gluon_w4a16_async_timing_log.txt)
BEST_EXISTING = {
    (8192, 8192, 1): dict(block_m=16, block_n=256, stages=8, kc=32, split_k=None, regs="async"),
    (8192, 8192, 16): dict(block_m=16, block_n=128, stages=8, kc=32, split_k=None, regs="async"),
    (8192, 28672, 1): dict(block_m=16, block_n=256, stages=8, kc=32, split_k=None, regs="async"),
    (8192, 28672, 16): dict(block_m=16, block_n=256, stages=8, kc=32, split_k=None, regs="async"),
}


def label(cfg):
    return (f"bm{cfg['block_m']} bn{cfg['block_n']} s{cfg['stages']} kc{cfg['kc']}"
            f"{'' if cfg.get('split_k') is None else ' sk' + str(cfg['split_k'])}"
            f"{' ' + cfg['regs'] if cfg.get('regs') else ''}"
            f"{' deq=' + cfg['deq'] if cfg.get('deq') else ''}{' pdl' if cfg.get('pdl') else ''}"
            f"{' ' + cfg['schedule'] if cfg.get('schedule') else ''}"
            f"{' sms' + str(cfg['num_sms']) if cfg.get('num_sms') else ''}")


def check_cfgs(M, K, N):
    cfgs = KG.gluon_w4a16_small_configs(M, K, N)
    extra = [dict(c, split_k=1) for c in cfgs if c["block_n"] == 256 and c["pdl"]]
    return cfgs + extra


_PACKED = {}


def packed_ref(K, N):
    """Packed weights (on the GPU) and their float64 dequantization, cached per shape."""
    if (K, N) not in _PACKED:
        q, s, z = make_packed(K, N)
        _PACKED[(K, N)] = (q, s, z, dequantize(q.cpu(), s.cpu(), z.cpu(), G, dtype=torch.float64))
    return _PACKED[(K, N)]


def sk_check_cases(M, K, N):
    """Stream-K configs checked at this shape and M (section (b) of the module docstring)."""
    cfgs = list(KG.gluon_w4a16_streamk_configs(M, K, N))
    if (K, N, M) == (4096, 11008, 16) and cfgs:
        # 7 CTAs: ranges of about 6 whole tiles (the direct-store epilogue of both consumers, many segments per CTA)
        cfgs += [dict(c, num_sms=7) for c in cfgs if c["block_n"] == 256]
        cfgs.append({k: v for k, v in cfgs[0].items() if k != "regs"})  # default register split
    return cfgs


def check_streamk(deadline):
    rows, bad = [], 0
    for K, N in SK_CHECK_SHAPES:
        q, s, z, w64 = packed_ref(K, N)
        bias = torch.randn(N).bfloat16()
        for M in SK_CHECK_MS:
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
            ref0 = x.double() @ w64.T
            refs = {False: ref0, True: ref0 + bias.double()}
            for cfg in sk_check_cases(M, K, N):
                for has_b in (False, True):
                    if time.time() > deadline:
                        print("stream-K check: time budget spent, skipping the rest", flush=True)
                        return rows, bad + 1
                    ok, err = check_launches(x, q, s, z, bias if has_b else None, refs[has_b],
                                             cfg, TOL)
                    bad += not ok
                    rows.append(dict(K=K, N=N, M=M, dtype="bfloat16", bias=has_b, cfg=cfg, ok=ok, err=err))
                    print(f"K={K} N={N} M={M} bfloat16 bias={has_b} {label(cfg)}: {'PASS' if ok else 'FAIL'} {err}",
                          flush=True)
    return rows, bad


def check(deadline):
    rows, bad = [], 0
    plan = [(K, N, M, torch.bfloat16) for K, N in CHECK_SHAPES for M in CHECK_MS if M != 3 or K == 1024]
    plan += [(1024, 1024, M, torch.float16) for M in (1, 16)]
    for K, N, M, dt in plan:
        q, s, z, w64 = packed_ref(K, N)
        if dt != torch.bfloat16:  # fp16 copies of the same (exactly representable) scales / integer zeros
            s, z = s.to(dt), z.to(dt)
            w64 = dequantize(q.cpu(), s.cpu(), z.cpu(), G, dtype=torch.float64)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dt)
        bias = torch.randn(N).to(dt)
        for cfg in check_cfgs(M, K, N):
            for b in ((None, bias) if dt == torch.bfloat16 else (None, )):
                if time.time() > deadline:
                    print("check: time budget spent, skipping the rest", flush=True)
                    return rows, bad + 1
                ref = x.double() @ w64.T + (0 if b is None else b.double())
                ok, err = check_launches(x, q, s, z, b, ref, cfg, TOL)
                bad += not ok
                rows.append(dict(K=K, N=N, M=M, dtype=str(dt).split(".")[-1], bias=b is not None, cfg=cfg, ok=ok,
                                 err=err))
                print(f"K={K} N={N} M={M} {str(dt).split('.')[-1]} bias={b is not None} {label(cfg)}: "
                      f"{'PASS' if ok else 'FAIL'} {err}", flush=True)
    return rows, bad


def timing(deadline, save):
    """Phase 1: bf16, the best existing config and every candidate, for every shape and M; phase 2: the op (its
    first call per shape and M bucket tunes, which may compile many configs: last, so it cannot starve phase 1).
    ``save(rows)`` after every measurement (the watchdog may end the run)."""
    import fxopt.kernels.w4a16 as K4

    out = []
    for phase in ("kernels", "op"):
        for K, N in TIME_SHAPES:
            if time.time() > deadline:
                print("timing: time budget spent, skipping the rest", flush=True)
                return out
            sets = [(torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device="cuda"),
                     (torch.rand(K // G, N, device="cuda") * 0.02 + 0.005).bfloat16(),
                     torch.randint(4, 12, (K // G, N), device="cuda").bfloat16())
                    for _ in range(rotations(K * N // 2))]
            bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
                  for _ in range(rotations(K * N * 2))] if phase == "kernels" else []
            for M in TIME_MS:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                if phase == "op":
                    runs = [("op", None, lambda it: torch.ops.fxopt.w4a16_linear(x, *it, G), sets)]
                else:
                    best = BEST_EXISTING[(K, N, M)]
                    runs = [("bf16", None, lambda w: F.linear(x, w), bf),
                            ("existing", best,
                             lambda it, c=best: KG.gluon_w4a16_mm(x, *it, G, check_zeros=False, **c), sets)]
                    for cfg in KG.gluon_w4a16_streamk_configs(M, K, N):  # before the small ones: priority
                        runs.append(("streamk", cfg,
                                     lambda it, c=cfg: KG.gluon_w4a16_mm(x, *it, G, check_zeros=False, **c), sets))
                    for cfg in KG.gluon_w4a16_small_configs(M, K, N):
                        runs.append(("small", cfg,
                                     lambda it, c=cfg: KG.gluon_w4a16_mm(x, *it, G, check_zeros=False, **c), sets))
                for kind, cfg, fn, items in runs:
                    if time.time() > deadline:
                        print("timing: time budget spent, skipping the rest", flush=True)
                        return out
                    extra = {}
                    try:
                        if kind == "op":
                            extra["cfg_op"] = K4.choose_config(x, *sets[0], G).label()  # tune outside the graph
                        us = streamed_us(fn, items)
                    except Exception as e:  # noqa: BLE001
                        print(f"  K={K} N={N} M={M} {kind} {'' if cfg is None else label(cfg)} failed: "
                              f"{type(e).__name__}: {str(e)[:160]}", flush=True)
                        continue
                    out.append(dict(timing=True, K=K, N=N, M=M, kind=kind, cfg=cfg, us=us, **extra))
                    save(out)
                    print(f"[bench] K={K} N={N} M={M} {kind:8s} {us:7.1f} us  "
                          f"{label(cfg) if cfg else extra.get('cfg_op', '')}", flush=True)
            del sets, bf
            torch.cuda.empty_cache()
    return out


def summarize(rows):
    lines = []
    for K, N in TIME_SHAPES:
        for M in TIME_MS:
            r = [x for x in rows if x.get("timing") and x["K"] == K and x["N"] == N and x["M"] == M]
            if not r:
                continue
            t = {x["kind"]: x for x in r if x["kind"] not in ("small", "streamk")}
            small = sorted((x for x in r if x["kind"] == "small"), key=lambda x: x["us"])
            sk = sorted((x for x in r if x["kind"] == "streamk"), key=lambda x: x["us"])
            bf = t.get("bf16", {}).get("us")
            parts = [f"K={K} N={N} M={M}:"]
            for kind in ("bf16", "op", "existing"):
                if kind in t:
                    parts.append(f"{kind} {t[kind]['us']:.1f}")
            if small:
                parts.append(f"best small {small[0]['us']:.1f} ({label(small[0]['cfg'])})")
                if bf:
                    parts.append(f"= {bf / small[0]['us']:.2f}x bf16")
            if sk:
                parts.append(f"best stream-K {sk[0]['us']:.1f} ({label(sk[0]['cfg'])})")
                if bf:
                    parts.append(f"= {bf / sk[0]['us']:.2f}x bf16")
            lines.append(" ".join(parts))
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="directory for gluon_w4a16_small_check.json")
    p.add_argument("--quick", action="store_true", help="accepted for device_session.sh; the run is the same")
    p.add_argument("--time-only", action="store_true", help="skip the correctness check")
    p.add_argument("--check-only", action="store_true", help="skip the timing")
    p.add_argument("--budget", type=float, default=145, help="seconds before the watchdog exits")
    args = p.parse_args()
    faulthandler.dump_traceback_later(args.budget, exit=True)  # a wrong mbarrier phase would hang
    t0 = time.time()
    if not KG.HAS_GLUON or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs Triton Gluon and an sm_90 GPU", flush=True)
        os._exit(2)
    rows, bad = [], 0

    def save(timing_rows=()):
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            all_rows = rows + list(timing_rows)
            with open(os.path.join(args.out, "gluon_w4a16_small_check.json"), "w") as f:
                json.dump(dict(rows=all_rows, failures=bad, summary=summarize(all_rows),
                               seconds=time.time() - t0), f, indent=1, default=str)

    if not args.time_only:
        rows, bad = check(t0 + 0.3 * args.budget)
        print("small-M check:", "ALL PASS" if bad == 0 else f"{bad} FAIL", f"({len(rows)} cases)", flush=True)
        save()
        sk_rows, sk_bad = check_streamk(t0 + 0.5 * args.budget)
        rows += sk_rows
        bad += sk_bad
        print("stream-K check:", "ALL PASS" if sk_bad == 0 else f"{sk_bad} FAIL", f"({len(sk_rows)} cases)",
              flush=True)
        save()
    if not args.check_only:
        rows += timing(t0 + 0.93 * args.budget, save)
    save()
    for line in summarize(rows):
        print("[summary]", line, flush=True)
    faulthandler.cancel_dump_traceback_later()
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    sys.stdout.flush()
    os._exit(0 if bad == 0 else 1)  # do not wait on a possibly wedged context at interpreter exit


if __name__ == "__main__":
    main()
