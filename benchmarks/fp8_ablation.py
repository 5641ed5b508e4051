"""TIMING-ONLY ablations of the Gluon fp8 attention forward (``fxopt/kernels/fp8_attention_gluon.py``, constexpr
``ABLATE``, module docstring "ablate"): what does its ~2,500-cycle step wait on?

Each build leaves parts of the main-loop step out (the results are WRONG; the script sets
``FXOPT_FP8_GLUON_ABLATE_OK=1`` for its own launches): bit 1 the exp2s, 2 the row max, 4 the O rescale, 8 the PV
wgmma, 16 the QK^T wgmma, 32 the e4m3 cast of P, 64 the row sum; plus 1|2|4 (softmax all but the cast and the
row sum), 1|2|4|64, 8|16 (no MMA at all) and the opt-in ``mma_rowsum=True`` build (ablate 0).

H200, d = 128, H = 16, B * S = 16384, S in {4096, 16384}, causal and not; kernel alone (quantization outside the
timed call, as benchmarks/fp8_rowsum_check.py does); every build in rotated order for ``--rounds`` rounds, median
per build. Reports TFLOP/s of the full attention's FLOPs (``tflops``: for an ablated build a speed, not real work)
and cycles per step = time x SM clock x SMs / (key-block steps of all CTAs) (one CTA per SM: 148 KB of shared
memory), and the cycles per step each ablation saves against ablate 0. The SM clock is sampled with
``nvidia-smi --query-gpu=clocks.sm,utilization.gpu -lms 100`` while the timings run (median of the samples with
utilization >= 50% during the case); without nvidia-smi 1.83 GHz is assumed (``clock_src`` says which).

The builds are compiled first by ``--warm-procs`` worker processes in parallel (one launch each on the S = 4096
case: Triton's disk cache then serves the timed process; the S = 16384 launches have the same specialization).
A watchdog per launch dumps the stacks and exits if one hangs. Writes ``fp8_ablation.json`` / ``.md`` into
``--out`` after every case. Without CUDA it prints that and exits with status 2.

    PYTHONUNBUFFERED=1 python benchmarks/fp8_ablation.py --out $OUT          # < 3 minutes on an H200
    (--quick: short do_bench; --masks 0,8,16 --no-rowsum: fewer builds)
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arm_watchdog, env_info, markdown_table, parse_args, round_order, save_state, try_bench_ms  # noqa: E402

import torch  # noqa: E402

NAME = "fp8_ablation"
STATE = {"env": {}, "notes": [], "summary": [], "bench": [], "warm": []}
DEFAULT_MASKS = "0,1,2,4,8,16,32,64,7,71,24"
NOMINAL_CLOCK_GHZ = 1.83
D, H, TOKENS = 128, 16, 16384


def _extra(p):
    p.add_argument("--masks", default=DEFAULT_MASKS, help="ABLATE masks to time (0 = the default build)")
    p.add_argument("--no-rowsum", action="store_true", help="leave out the mma_rowsum=True build")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds (builds rotated each round)")
    p.add_argument("--seqs", default="4096,16384")
    p.add_argument("--launch-timeout", type=float, default=90.0, help="watchdog per launch (first launch compiles)")
    p.add_argument("--warm-procs", type=int, default=8, help="processes compiling the builds in parallel (0: off)")


def _save(out_dir):
    save_state(out_dir, NAME, STATE, "Gluon fp8 attention forward: timing-only ablations (d = 128)",
               [("Cycles per step by build (saved vs ablate 0 in parentheses)", "summary"),
                ("All timings (kernel alone, median of rotated rounds)", "bench"),
                ("Parallel compile warm-up", "warm")])


def build_list(masks: str, rowsum: bool):
    """[(name, kwargs)]: ablate masks, then the mma_rowsum build."""
    out = []
    for m in (int(x, 0) for x in masks.split(",") if x.strip()):
        out.append((f"ablate{m}", {"ablate": m}))
    if rowsum:
        out.append(("rowsum", {"mma_rowsum": True}))
    return out


def label(G, name, kw) -> str:
    if "ablate" in kw:
        m = kw["ablate"]
        return "default" if m == 0 else "no " + " + no ".join(G.ABLATE_BITS[b] for b in sorted(G.ABLATE_BITS) if m & b)
    return "mma_rowsum=True"


def total_steps(B: int, S: int, causal: bool, block: int = 128) -> int:
    """Key-block steps over all CTAs (128 query rows each; Sq = Sk = S): block 0 + loop steps of each CTA."""
    nm = S // block
    return B * H * (nm * (nm + 1) // 2 if causal else nm * nm)


def _case_tensors(G, S):
    B = TOKENS // S
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    qq, qs, kq, ks, vt, vs = G.fp8_gluon_quantize(q, k, v)
    del q, k, v
    return B, (qq, qs, kq, ks, vt, vs)


def _warm_worker(jobs):
    """Spawned: launch each (kwargs, causal) once on the S = 4096 case so that Triton's disk cache holds it."""
    os.environ["FXOPT_FP8_GLUON_ABLATE_OK"] = "1"
    os.environ["FXOPT_FP8_GLUON_UNCHECKED"] = "1"
    import fxopt.kernels.fp8_attention_gluon as G

    done = []
    try:
        B, t = _case_tensors(G, 4096)
        out = torch.empty(B, H, 4096, D, device="cuda", dtype=torch.bfloat16)
        for kw, causal in jobs:
            t0 = time.time()
            try:
                G.fp8_gluon_attention_quantized(*t, shape_q=(B, H, 4096, D), seq_k=4096, n_kv_heads=H,
                                                out_dtype=torch.bfloat16, is_causal=causal, out=out, **kw)
                torch.cuda.synchronize()
                done.append((repr(kw), causal, round(time.time() - t0, 1), "ok"))
            except Exception as e:
                done.append((repr(kw), causal, round(time.time() - t0, 1), f"{type(e).__name__}: {str(e)[:200]}"))
    except Exception as e:
        done.append(("worker", None, 0.0, f"{type(e).__name__}: {str(e)[:200]}"))
    return done


def warm_compile(builds, causals, procs: int, timeout: float):
    import multiprocessing as mp

    jobs = [(kw, c) for _, kw in builds for c in causals]
    if procs <= 0 or not jobs:
        return
    procs = min(procs, len(jobs), max(1, (os.cpu_count() or 2) - 1))
    chunks = [jobs[i::procs] for i in range(procs)]
    arm_watchdog(timeout)
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(procs) as pool:
        for res in pool.map(_warm_worker, chunks):
            for kw, c, sec, status in res:
                STATE["warm"].append(dict(build=kw, causal=c, sec=sec, status=status))
    STATE["notes"].append(f"warm-up: {len(jobs)} compiles in {procs} processes, {time.time() - t0:.0f} s")
    print(f"[warm] {len(jobs)} compiles in {procs} processes: {time.time() - t0:.0f} s", flush=True)


class ClockSampler:
    """SM clock (MHz) and utilization from ``nvidia-smi -lms`` in a background thread."""

    def __init__(self, period_ms: int = 100):
        self.samples = []  # (time, MHz, util %)
        self.proc = None
        self.max_mhz = None
        try:
            dev = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
            q = subprocess.run(["nvidia-smi", "-i", dev, "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=20)
            self.max_mhz = float(q.stdout.strip().splitlines()[0]) if q.returncode == 0 else None
            self.proc = subprocess.Popen(["nvidia-smi", "-i", dev, "--query-gpu=clocks.sm,utilization.gpu",
                                          "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True).start()
        except Exception as e:  # no nvidia-smi: the nominal clock is used
            print(f"(no nvidia-smi clock samples: {type(e).__name__}: {e})", flush=True)
            self.proc = None

    def _read(self):
        for line in self.proc.stdout:
            try:
                mhz, util = (float(x) for x in line.strip().split(","))
                self.samples.append((time.time(), mhz, util))
            except ValueError:
                pass

    def clock_ghz(self, t0: float, t1: float):
        busy = [mhz for t, mhz, u in self.samples if t0 <= t <= t1 and u >= 50]
        if busy:
            return statistics.median(busy) / 1e3, f"nvidia-smi median of {len(busy)} busy samples"
        return NOMINAL_CLOCK_GHZ, "nominal 1.83 GHz (no busy nvidia-smi sample)"

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()


def run_case(G, builds, S, causal, args, sampler, n_sm):
    B, t = _case_tensors(G, S)
    kw0 = dict(shape_q=(B, H, S, D), seq_k=S, n_kv_heads=H, out_dtype=torch.bfloat16, is_causal=causal)
    out = torch.empty(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    steps = total_steps(B, S, causal)
    names = [n for n, _ in builds]
    kws = dict(builds)
    times = {n: [] for n in names}
    t_start = time.time()
    for r in range(args.rounds):
        order = round_order(names, r)
        for n in order:
            arm_watchdog(args.launch_timeout)
            ms = try_bench_ms(lambda: G.fp8_gluon_attention_quantized(*t, out=out, **kw0, **kws[n]), args.quick)
            if ms:
                times[n].append(ms)
    ghz, src = sampler.clock_ghz(t_start, time.time())
    rows = []
    base = None
    for n in names:
        if not times[n]:
            rows.append(dict(S=S, causal=causal, build=n, what=label(G, n, kws[n]), ms=None))
            continue
        ms = statistics.median(times[n])
        cyc = ms * 1e-3 * ghz * 1e9 * n_sm / steps
        if n == "ablate0":
            base = (ms, cyc)
        rows.append(dict(S=S, causal=causal, build=n, what=label(G, n, kws[n]), ms=round(ms, 4),
                         tflops=round(flops / (ms * 1e-3) / 1e12, 1), cycles_per_step=round(cyc),
                         clock_ghz=round(ghz, 3), clock_src=src, rounds=len(times[n]),
                         spread=round((max(times[n]) - min(times[n])) / ms, 4)))
    for row in rows:
        if base and row.get("ms"):
            row["saved_cycles"] = round(base[1] - row["cycles_per_step"])
            row["speedup"] = round(base[0] / row["ms"], 3)
    return rows


def main():
    args = parse_args("Gluon fp8 attention forward: timing-only ablations", _extra)
    if not torch.cuda.is_available():
        print("fp8_ablation: needs a CUDA GPU (sm_90); nothing to do on this machine")
        return 2
    os.environ["FXOPT_FP8_GLUON_ABLATE_OK"] = "1"  # this script's launches are timing-only on purpose
    os.environ["FXOPT_FP8_GLUON_UNCHECKED"] = "1"  # and time the mma_rowsum build, refused since its failed check
    import fxopt.kernels.fp8_attention_gluon as G

    STATE["env"] = env_info()
    STATE["args"] = vars(args)
    if G._GLUON_IMPORT_ERROR or G.device_capability(torch.device("cuda"))[0] != 9:
        STATE["notes"].append(f"not runnable: gluon {G._GLUON_IMPORT_ERROR}, capability "
                              f"{G.device_capability(torch.device('cuda'))}")
        _save(args.out)
        return 1
    builds = build_list(args.masks, not args.no_rowsum)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    STATE["notes"].append(f"{n_sm} SMs; default build permute_k={G.PERMUTE_K_DEFAULT} cast_late={G.CAST_LATE_DEFAULT}; "
                          f"d={D} H={H} B*S={TOKENS}; ablate bits {G.ABLATE_BITS}")
    t_all = time.time()
    try:
        warm_compile(builds, (False, True), args.warm_procs, 60.0 + 30.0 * len(builds))
    except Exception as e:  # the timed process compiles what is missing
        STATE["notes"].append(f"warm-up failed: {type(e).__name__}: {str(e)[:200]}")
        traceback.print_exc()
    sampler = ClockSampler()
    STATE["notes"].append(f"clocks.max.sm = {sampler.max_mhz} MHz")
    try:
        for S in (int(x) for x in args.seqs.split(",")):
            for causal in (False, True):
                rows = run_case(G, builds, S, causal, args, sampler, n_sm)
                torch.cuda.empty_cache()
                STATE["bench"].extend(rows)
                case = f"S{S}{'_causal' if causal else ''}"
                for row in rows:
                    summ = next((s for s in STATE["summary"] if s["build"] == row["build"]), None)
                    if summ is None:
                        summ = dict(build=row["build"], what=row["what"])
                        STATE["summary"].append(summ)
                    summ[case] = (f"{row['cycles_per_step']} ({row.get('saved_cycles', 0):+d}) "
                                  f"{row['tflops']:.0f} TF" if row.get("ms") else "-")
                print(f"[bench] S={S} causal={causal} clock {rows[0].get('clock_ghz')} GHz: " + "  ".join(
                    f"{r['build']} {r['tflops']:.0f}TF/{r['cycles_per_step']}cyc" if r.get("ms") else f"{r['build']} -"
                    for r in rows), flush=True)
                _save(args.out)
    finally:
        sampler.stop()
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    STATE["notes"].append(f"total {time.time() - t_all:.0f} s")
    _save(args.out)
    print(markdown_table(STATE["summary"]))
    return 0 if all(r.get("ms") for r in STATE["bench"]) else 1


if __name__ == "__main__":
    sys.exit(main())
