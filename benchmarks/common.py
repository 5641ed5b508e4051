"""Shared conventions for fxopt benchmarks.

Every benchmark script measures fxopt *and* its anchor (cuBLAS, cuDNN, FA2, tinygemm, ...) in the same run, prints a
table, and writes ``benchmarks/results/<name>.json`` and ``<name>.md`` with the device name and torch / Triton
versions, so the committed tables say where and how they were made. Timings are medians of
``triton.testing.do_bench`` (CUDA events), on random inputs, never zeros.

Usage::

    from common import bench_ms, write_results
    rows = [{"shape": "...", "fxopt_ms": bench_ms(lambda: f(x)), "anchor_ms": bench_ms(lambda: g(x))}]
    write_results("w4a16", rows, title="W4A16 linear", notes="...")

``--out DIR`` (parsed by :func:`parse_args`) writes the files somewhere else (e.g. ``$OUT`` on the device machine).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, no install


def parse_args(description: str, extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=RESULTS_DIR, help="directory for the JSON and markdown results")
    p.add_argument("--quick", action="store_true", help="a few rows only (smoke run)")
    if extra:
        extra(p)
    return p.parse_args()


def env_info() -> dict:
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    if torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
    return info


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds (CUDA events through ``triton.testing.do_bench``).

    Without CUDA (smoke runs of the scripts on CPU): the median of a few wall-clock timings.
    """
    if not torch.cuda.is_available():
        import statistics
        import time

        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def streamed_us(fn, items, calls: int = 48, reps: int = 20) -> float:
    """Per-call time (us) of ``fn(item)`` when calls run back to back, each on the next rotated item (weight or K/V
    copies that together exceed L2 several times, so none is read from L2), as the layers of a model's forward pass
    run. One CUDA graph holds ``calls`` calls; its replays are timed with events. Nothing else runs between calls, in
    particular no L2 flush whose dirty lines the timed call would have to write back. The W4A16 tuner times its
    small-M candidates the same way (the same function)."""
    from fxopt.kernels.w4a16 import bench_streamed_us

    return bench_streamed_us(fn, items, reps, calls)


def bench_ms_fixed(fn, warmup: int = 10, iters: int = 100) -> float:
    """Median time of ``fn()`` in ms over a fixed number of calls: for functions that hold collectives.

    ``triton.testing.do_bench`` picks its repetition count from a timing estimate, so two ranks may call ``fn`` a
    different number of times; the extra collectives of one rank then wait for partners that never come (the TP
    benchmark hung that way on the H200s). Every rank here calls ``fn`` exactly ``warmup + iters`` times.
    """
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        import statistics
        import time

        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return float(times[len(times) // 2])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(rows[0].keys())
    for r in rows[1:]:
        cols += [c for c in r if c not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def round_order(names: list, r: int) -> list:
    """Round r's timing order of an interleaved comparison: step through ``names`` by the round's stride s (the
    strides coprime to n in turn: 1, 2, 3, 4 for five candidates, 1, 3 for four), starting at index r (s + 1) mod n.
    Each candidate's predecessor within a round is the one s places before it in ``names``, so it changes between
    consecutive rounds for n >= 3. A plain rotation keeps the cyclic order: each candidate not first in its round
    ran right after the same one, and measured one Gluon kernel 1-7% slower as fwd_fxopt (after cuDNN in
    two of three rounds) than as fwd_gluon (after the Triton kernel) on all six d = 128 non-causal rows."""
    import math

    n = len(names)
    strides = [s for s in range(1, n) if math.gcd(s, n) == 1] or [1]
    s = strides[r % len(strides)]
    return [names[(r * (s + 1) + i * s) % n] for i in range(n)]


def write_results(name: str, rows: list[dict], *, title: str, notes: str = "", out_dir: str | None = None,
                  command: str | None = None, echo: bool = True) -> None:
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    info = env_info()
    command = command or "python " + " ".join(sys.argv)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"title": title, "env": info, "command": command, "notes": notes, "rows": rows}, f, indent=1)
    env_line = ", ".join(f"{k} {v}" for k, v in info.items())
    md = f"# {title}\n\n{env_line}\n\nCommand: `{command}`\n\n{markdown_table(rows)}"
    if notes:
        md += f"\n{notes}\n"
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    if echo:
        print(markdown_table(rows))
        print(f"wrote {out_dir}/{name}.json and .md")


# ---- helpers of the Gluon check scripts (a wrong mbarrier phase hangs the GPU instead of failing)


def arm_watchdog(seconds: float) -> None:
    """(Re)arm a watchdog: after ``seconds`` every thread's stack is printed and the process hard-exits."""
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(seconds, exit=True)


def try_bench_ms(fn, quick: bool, width: int = 160):
    """Median ms of ``fn`` (short do_bench with ``quick``), or None, with the error's first line printed, when the
    backend does not take the inputs."""
    import triton.testing

    try:
        fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100,
                                             return_mode="median"))
    except Exception as e:  # a backend that does not support the shape
        print(f"    ({type(e).__name__}: {str(e).splitlines()[0][:width] if str(e) else ''})", flush=True)
        return None


def save_state(out_dir: str, name: str, state: dict, title: str, sections: list) -> None:
    """Write a check script's ``state`` as ``<name>.json`` and a markdown page: the title, the environment, the
    command, then one table per (heading, state key) of ``sections``, then ``state["notes"]``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(state, f, indent=1, default=str)
    md = [f"# {title}\n", ", ".join(f"{k} {v}" for k, v in (state["env"] or {}).items()) + "\n",
          f"Command: `python {' '.join(sys.argv)}`\n"]
    for i, (heading, key) in enumerate(sections):
        md += [("\n" if i else "") + f"## {heading}\n", markdown_table(state[key])]
    if state["notes"]:
        md += ["\n## Notes\n"] + [f"- {n}\n" for n in state["notes"]]
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(md))
