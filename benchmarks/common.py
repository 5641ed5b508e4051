"""Shared conventions for fxopt benchmarks.

Every benchmark script measures fxopt *and* its anchor (cuBLAS, cuDNN, FA2, tinygemm, ...) in the same run, prints a
table, and writes ``benchmarks/results/<name>.json`` and ``<name>.md`` with the device name and torch / Triton
versions, so the committed tables say where and how they were made. Timings are medians of
``triton.testing.do_bench`` (CUDA events), on random inputs, never zeros.

Usage::

    from common import bench_ms, write_results
    rows = [{"shape": "...", "fxopt_ms": bench_ms(lambda: f(x)), "anchor_ms": bench_ms(lambda: g(x))}]
    write_results("w4a16", rows, title="W4A16 linear", notes="...")

Each script writes one file pair named after it. A script with several modes writes each as a part of that pair
(``write_results("distributed", rows, part="plan", ...)``): a run replaces only its own part's section.
``--out DIR`` (parsed by :func:`parse_args`) writes the files somewhere else (e.g. ``$OUT`` on the device machine).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, no install


def parse_args(description: str, extra=None, smoke=None) -> argparse.Namespace:
    """The common flags, ``extra(parser)``'s, parsed; ``smoke(args)`` true: results go to a temporary directory
    unless ``--out`` is given (a CPU smoke run never overwrites the committed tables)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None, help="directory for the JSON and markdown results (default "
                   "benchmarks/results; a temporary directory for smoke runs)")
    p.add_argument("--quick", action="store_true", help="a few rows only (smoke run)")
    if extra:
        extra(p)
    args = p.parse_args()
    args.out = args.out or default_out(bool(smoke and smoke(args)))
    return args


def default_out(smoke: bool) -> str:
    """``benchmarks/results``, or for a smoke run a fresh temporary directory."""
    return tempfile.mkdtemp(prefix="fxopt-bench-smoke-") if smoke else RESULTS_DIR


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
                  command: str | None = None, echo: bool = True, part: str | None = None) -> None:
    """Write ``<name>.json`` and ``<name>.md`` in ``out_dir``.

    With ``part``, the file holds one section per part (``{"parts": {part: {title, env, command, notes, rows}}}``):
    this call replaces only its own part's section, keeps the others of an existing ``<name>.json``, and rewrites
    ``<name>.md`` with a ``##`` section per part, each with its own environment and command.
    """
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    section = {"title": title, "env": env_info(), "command": command or "python " + " ".join(sys.argv),
               "notes": notes, "rows": rows}
    if part is None:
        data, md = section, _section_md(section, "#")
    else:
        parts = {}
        if os.path.exists(json_path):
            with open(json_path) as f:
                parts = json.load(f).get("parts", {})
        parts[part] = section
        data = {"parts": parts}
        md = f"# benchmarks/{name}.py\n\n" + "\n".join(_section_md(s, "##", p) for p, s in parts.items())
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    if echo:
        print(markdown_table(rows))
        print(f"wrote {out_dir}/{name}.json and .md" + (f" (part {part})" if part else ""))


def _section_md(s: dict, heading: str, part: str | None = None) -> str:
    env_line = ", ".join(f"{k} {v}" for k, v in s["env"].items())
    md = (f"{heading} {f'{part}: ' if part else ''}{s['title']}\n\n{env_line}\n\nCommand: `{s['command']}`\n\n"
          + markdown_table(s["rows"]))
    return md + (f"\n{s['notes']}\n" if s["notes"] else "")
