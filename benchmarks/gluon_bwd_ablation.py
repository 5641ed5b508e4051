"""Timing-only ablations of the Gluon attention backward at d = 128 (variant 3, the op's route; session 11).

Each ablation is a build of ``_fa3_bwd_kernel_v1`` with the constexpr ``ABLATE`` (a bit mask, see
``attention_gluon_bwd.ABLATE_BITS``) that leaves one stage of the step out; its RESULTS ARE WRONG, only its time
means something. The step time it saves says what that stage costs on the critical path:

    1   dQ global reductions predicated off (the dQ wgmma, its wait and the issue slots stay; no memory traffic)
    2   proxy fence after the dS^T store (SASS MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S)
    4   dQ wgmma + wait + reductions
    8   exp2 (no MUFU.EX2; P^T = the exponent)
    16  wait on the other warpgroup's dS^T publication (ds_bar); 17 = 1 | 16

``--variant`` 1-4 only: variant 5 (dQ through shared memory, ``DQW``) has no REDG dQ path to ablate, so
``gluon_attention_bwd`` refuses ``ablate`` with it (mask 0 would time the real variant-5 kernel).

Shapes: d = 128, H = 16, 16k tokens (B = 16384 / S), S in {4096, 16384}, causal and not, bf16. Per (shape,
ablation) the median of ``triton.testing.do_bench`` medians over ``--rounds`` rounds; each round runs the ablations
in a rotated order. TFLOP/s counts the FULL backward's FLOPs (10 B H S^2 d, halved for causal) whatever the
ablation. Cycles per CTA step = time x clock x SMs / (CTA steps of the launch), i.e. one CTA per SM with the steps
spread evenly; the preprocess / convert launches (~1% at 16k tokens) are inside the time and cancel in the
differences. The clock is the SM clock nvidia-smi reports while a batch of backward launches runs (else
``torch.cuda.clock_rate()``, else 1.83 GHz); the json says which.

``--dim 256`` (session 13): the same ablations of the d = 256 kernel ``_fa3_bwd_kernel_d256`` (64 keys per CTA,
the head dim of dK / dV / dQ split between the consumer warpgroups; ``ABLATE_BITS_D256``: 1 = its 32 REDG.F32x2 per
step and warpgroup predicated off, 2 = the proxy fence after the P^T / dS^T stores, 4 = the dQ wgmma + wait +
reductions, 8 = exp2, 16 = the x_bar wait for the other warpgroup's P^T / dS^T halves). Every variant runs that
kernel at d = 256, so ``--variant`` does not matter there. H = 2048 / d = 8, 16k tokens, the same S, rounds,
rotation and clock method; CTA steps count 64-key blocks. Output ``gluon_bwd_ablation_d256.{json,md}`` (d = 128
keeps ``gluon_bwd_ablation.{json,md}``).

A hang (an ablation that breaks the barrier protocol) must not eat the device call: every launch re-arms a
``faulthandler`` watchdog (``--launch-timeout``, compile included) that dumps the stacks and exits the process;
results are written after every measurement.

    python benchmarks/gluon_bwd_ablation.py --out $OUT            # < 3 minutes on an H200
    python benchmarks/gluon_bwd_ablation.py --dim 256 --out $OUT  # d = 256
"""
from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import threading
import time

os.environ["FXOPT_ATTN_GLUON_BWD_ABLATE_OK"] = "1"   # this script only: timing-only builds
os.environ.setdefault("FXOPT_ATTN_AUTOTUNE", "0")    # the Triton forward (out / lse) without autotuning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arm_watchdog, env_info, markdown_table, round_order, save_state  # noqa: E402

import torch  # noqa: E402

NAME = "gluon_bwd_ablation"  # d = 128; d = 256: NAME + "_d256"
STATE = {"env": None, "args": None, "clock": None, "rows": [], "summary": [], "notes": []}


def _args():
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--seqs", default="4096,16384")
    p.add_argument("--ablate", default="0,1,2,4,8,16,17", help="comma list of ABLATE masks (0 = the real kernel)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=int, default=40, help="do_bench rep (ms of timed calls per measurement)")
    p.add_argument("--launch-timeout", type=float, default=90.0)
    p.add_argument("--variant", type=int, default=3, help="d = 128 only (d = 256 runs its one kernel for any)")
    p.add_argument("--dim", type=int, default=128, choices=(128, 256), help="head dim (H = 2048 / dim)")
    return p.parse_args()


def cta_steps(S: int, B: int, Hkv: int, group: int, causal: bool, block_n: int = 128) -> int:
    """Query-block steps over all CTAs of ``_fa3_bwd_kernel_v1`` (``block_n`` = 128) or ``_fa3_bwd_kernel_d256``
    (``block_n`` = 64) with Sq = Sk = S: per key block n0 the CTA walks query blocks m_lo .. n_m - 1 (causal:
    m_lo = n0 // 64) of each of the ``group`` query heads."""
    n_m = math.ceil(S / 64)
    total = 0
    for nb in range(math.ceil(S / block_n)):
        m_lo = min(max(nb * block_n, 0) // 64, n_m) if causal else 0
        total += (n_m - m_lo) * group
    return total * B * Hkv


def _smi_clock_mhz():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm", "--format=csv,noheader,nounits",
                              "-i", str(torch.cuda.current_device())], capture_output=True, text=True, timeout=10)
        cur, mx = (float(x) for x in out.stdout.strip().splitlines()[0].split(","))
        return cur, mx
    except Exception as e:  # no nvidia-smi, odd output
        STATE["notes"].append(f"nvidia-smi clock query failed: {type(e).__name__}: {e}")
        return None, None


def measure_clock(fn) -> dict:
    """SM clock under this kernel's load: queue ~1.5 s of launches, sample nvidia-smi in the middle."""
    res = {"source": "default 1.83 GHz", "ghz": 1.83}
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    n = max(10, min(400, int(1.5 / max(one, 1e-4))))
    samples = []

    def sample():
        time.sleep(0.5)
        for _ in range(3):
            samples.append(_smi_clock_mhz())
            time.sleep(0.2)

    th = threading.Thread(target=sample)
    th.start()
    for _ in range(n):
        fn()
    th.join()
    torch.cuda.synchronize()
    cur = [c for c, _ in samples if c]
    if cur:
        res.update(source="nvidia-smi clocks.sm under load", ghz=statistics.median(cur) / 1e3,
                   samples_mhz=cur, max_mhz=samples[0][1])
    else:
        try:
            res.update(source="torch.cuda.clock_rate()", ghz=float(torch.cuda.clock_rate()) / 1e3)
        except Exception as e:
            STATE["notes"].append(f"torch.cuda.clock_rate() failed: {type(e).__name__}")
    return res


def _out_name(dim: int) -> str:
    return NAME if dim == 128 else f"{NAME}_d{dim}"


def _save(out, dim: int = 128):
    what = "variant 3" if dim == 128 else "_fa3_bwd_kernel_d256"
    title = f"Gluon attention backward (d = {dim}, {what}): timing-only ablations"
    save_state(out, _out_name(dim), STATE, title,
               [("Per ablation (median over rounds)", "summary"), ("Every measurement", "rows")])


def main():
    args = _args()
    STATE["args"] = vars(args)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90)")
        return 2
    t_start = time.time()
    arm_watchdog(args.launch_timeout + 60)
    STATE["env"] = env_info()
    import triton.testing

    import fxopt.kernels.attention_gluon_bwd as GB
    from fxopt.kernels.attention import flash_attention_triton

    if GB._GLUON_IMPORT_ERROR:
        print(f"gluon unavailable: {GB._GLUON_IMPORT_ERROR}")
        return 1
    masks = [int(x) for x in args.ablate.split(",") if x.strip()]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    D, H = args.dim, 2048 // args.dim
    bits = GB.ABLATE_BITS_D256 if D == 256 else GB.ABLATE_BITS
    block_n = GB.D256_BLOCK_N if D == 256 else GB.BLOCK_N
    STATE["notes"].append("ablate bits: " + "; ".join(f"{b}: {t}" for b, t in bits.items()))
    shapes = [(int(S), c) for S in args.seqs.split(",") for c in (False, True)]
    times = {}  # (S, causal, mask) -> [ms per round]
    inputs = {}
    for S, causal in shapes:
        B = 16384 // S
        gen = torch.Generator(device="cuda").manual_seed(S + causal)
        q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
        arm_watchdog(args.launch_timeout + 60)
        out, lse = flash_attention_triton(q, k, v, is_causal=causal, return_lse=True)
        inputs[(S, causal)] = (q, k, v, dout, out, lse)

    def call(S, causal, mask):
        q, k, v, dout, out, lse = inputs[(S, causal)]
        return GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, variant=args.variant, ablate=mask)

    # clock under the real kernel's load (the largest non-causal shape)
    S_big = max(S for S, _ in shapes)
    arm_watchdog(args.launch_timeout + 30)
    STATE["clock"] = measure_clock(lambda: call(S_big, False, 0))
    ghz = STATE["clock"]["ghz"]
    print(f"clock: {STATE['clock']}", flush=True)
    for r in range(args.rounds):
        order = round_order(masks, r)
        for S, causal in shapes:
            for mask in order:
                arm_watchdog(args.launch_timeout)  # compile (first round) + one measurement
                fn = lambda: call(S, causal, mask)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                ms = float(triton.testing.do_bench(fn, warmup=5, rep=args.rep_ms, return_mode="median"))
                times.setdefault((S, causal, mask), []).append(ms)
                STATE["rows"].append(dict(round=r, S=S, causal=causal, ablate=mask, ms=ms))
                _save(args.out, D)
        print(f"round {r} done ({time.time() - t_start:.0f} s)", flush=True)
    arm_watchdog(120)
    for S, causal in shapes:
        B = 16384 // S
        flops = 10.0 * B * H * S * S * D * (0.5 if causal else 1.0)
        steps = cta_steps(S, B, H, 1, causal, block_n)
        base = statistics.median(times[(S, causal, 0)]) if (S, causal, 0) in times else None
        base_cyc = base * 1e-3 * ghz * 1e9 * sms / steps if base else None
        for mask in masks:
            ms = statistics.median(times[(S, causal, mask)])
            cyc = ms * 1e-3 * ghz * 1e9 * sms / steps
            STATE["summary"].append(dict(
                S=S, causal=causal, ablate=mask, ms=ms, spread_pct=100 * (max(times[(S, causal, mask)])
                                                                          - min(times[(S, causal, mask)])) / ms,
                tflops=flops / (ms * 1e-3) / 1e12, cycles_per_step=cyc,
                saved_cycles=(base_cyc - cyc) if base_cyc else None,
                saved_pct=100 * (base - ms) / base if base else None,
                what="real kernel" if mask == 0 else " + ".join(bits[b] for b in bits if mask & b)))
    STATE["notes"].append(f"clock {ghz:.3f} GHz ({STATE['clock']['source']}), {sms} SMs; cycles per CTA step = "
                          "time x clock x SMs / CTA steps (one CTA per SM; preprocess / convert included)")
    STATE["notes"].append(f"total {time.time() - t_start:.0f} s")
    _save(args.out, D)
    print(markdown_table([{k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if k != "what"}
                          for row in STATE["summary"]]))
    print(f"wrote {args.out}/{_out_name(D)}.json and .md ({time.time() - t_start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # do not wait on a GPU that may still be stuck in a kernel
