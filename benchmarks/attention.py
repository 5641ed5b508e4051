"""FlashAttention benchmark: fxopt Triton kernels vs SDPA's FlashAttention-2 and cuDNN backends, same run.

Rows (bf16, 16k tokens per batch, hidden 2048): d in {64, 128, 256}, S in {512 .. 16384}, B = 16384 / S,
H = 2048 / d, causal and not. TFLOP/s = 4 * B * H * S^2 * d / time (halved for causal); fwd+bwd counts 3.5x the
forward FLOPs. Decode: B = 8, H = 32, d = 128, one query, S in {4096, 32768}, TB/s = K+V bytes / time.
``--quick``: a few rows; ``--shapes 128x1024,...``: only those rows. Writes ``results/attention.{md,json}``.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, parse_args, round_order, streamed_us, write_results  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from fxopt.kernels import attention as A  # noqa: E402
from fxopt.kernels import launch_plan as LP  # noqa: E402
from fxopt.kernels import use_kernels  # noqa: E402
from fxopt.kernels.attention import gluon_fwd as G  # noqa: E402
from fxopt.kernels.attention import launch, routing  # noqa: E402


def _rand(*shape, grad=False):
    t = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    return t.requires_grad_() if grad else t


BENCH = dict(warmup=25, rep=100)


def _graph(fn):
    """Capture fn() in a CUDA graph (decode serving style: no host launch overhead); returns replay."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _try(fn, graph=False):
    try:
        return bench_ms(_graph(fn) if graph else fn, **BENCH)
    except Exception as e:  # a backend that does not support the shape
        print(f"  ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return None


# Rounds of the interleaved timing: every candidate of a row is timed once per round, in the order of
# ``common.round_order`` (a new stride through the candidates each round), and the row reports the median over
# rounds. A single pass in a fixed order favours whatever runs first after a pause (one Gluon build timed twice in one
# row, as fwd_fxopt and fwd_gluon: 693 against 631 TFLOP/s), so it is not fair to the anchors timed last. A plain
# rotation by one each round keeps the cyclic order: each candidate not first in its round runs right after the same
# one (fxopt after cuDNN, fwd_gluon after fwd_triton), which put fwd_fxopt 1-7% under fwd_gluon on all six d = 128
# non-causal rows (same kernel, same arguments; equal at d = 64).
ROUNDS = int(os.environ.get("FXOPT_BENCH_ROUNDS", "3"))
# fwd+bwd also replayed from CUDA graphs (fbg_* columns). The eager fb_* columns include the host's launch path,
# and found ours host-bound at short S: 32 x 16 x 512 x 128 fwd+bwd spends 0.67-0.74 ms in kernels but
# 1.1-1.7 ms of host time per call on the H200 box (Python custom-op autograd layer and Triton / Gluon launchers;
# cuDNN's whole fwd+bwd path 0.64 ms). Under torch.compile with CUDA graphs,
# or in a model whose other layers keep the GPU busy while the host runs ahead, what counts is the GPU time, which
# the graph replay measures for every candidate alike. The forward too (fwdg_*: the op's launch path against
# cuDNN): do_bench zero-fills L2 before each call, so a launch path longer than that fill (~60 us) idles the GPU
# inside the timed interval, which an earlier fwd_fxopt (checks and routing) against fwd_gluon (the kernel's
# launcher alone) showed at 0-3.5%. FXOPT_BENCH_FB_GRAPH=0 skips them.
FB_GRAPH = os.environ.get("FXOPT_BENCH_FB_GRAPH", "1") != "0"


def _time_set(fns: dict, graph: bool = False) -> dict:
    """{name: median ms over ROUNDS rounds (``common.round_order``)} of {name: fn or None}; None for fns that fail or
    are None."""
    import statistics

    names = [n for n, f in fns.items() if f is not None]
    times = {n: [] for n in names}
    bench = dict(warmup=BENCH["warmup"], rep=max(10, BENCH["rep"] // max(1, ROUNDS)))
    for r in range(max(1, ROUNDS)):
        order = round_order(names, r)
        for n in order:
            if times[n] is None:
                continue
            try:
                times[n].append(bench_ms(_graph(fns[n]) if graph else fns[n], **bench))
            except Exception as e:  # a backend that does not support the shape
                print(f"  ({n}: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
                times[n] = None
    return {n: (statistics.median(times[n]) if n in times and times[n] else None) for n in fns}


def _sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_gqa(backend, q, k, v):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _fwd_bwd(f, q, k, v, do):
    return lambda: torch.autograd.grad(f(q, k, v), (q, k, v), do)


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _with_kernels(fn, **choices):
    """fn run with other kernel choices (``fxopt.kernels.use_kernels``), e.g. the Gluon forward off."""
    def run():
        with use_kernels(**choices):
            return fn()
    return run


def attention_rows(d, S, causal, bwd=True):
    B, H = 16384 // S, 2048 // d
    flops = 4 * B * H * S * S * d / (2 if causal else 1)
    q, k, v = (_rand(B, H, S, d, grad=True) for _ in range(3))
    do = torch.randn_like(q)
    ours = lambda a, b, c: torch.ops.fxopt.flash_attention(a, b, c, is_causal=causal)  # noqa: E731
    fa2 = lambda a, b, c: _sdpa(SDPBackend.FLASH_ATTENTION, a, b, c, causal)  # noqa: E731
    cud = lambda a, b, c: _sdpa(SDPBackend.CUDNN_ATTENTION, a, b, c, causal)  # noqa: E731
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    row = {"d": d, "S": S, "B": B, "H": H, "causal": causal}
    # the two forwards fxopt has, each on its own: the Triton-language kernel and the Gluon (FA3-style) one;
    # "fxopt" is whichever flash_attention_triton routes to (routing.ROUTES)
    gb = launch.gluon_forward_build(qd, kd, vd, is_causal=causal)  # the Gluon build the op runs, or None
    gv = gb.split(" ", 1)[1] if gb else ("persistent" if d in (64, 128) else "default")
    fwd = {
        "fxopt": lambda: A.flash_attention_triton(qd, kd, vd, is_causal=causal),
        "triton": _with_kernels(lambda: A.flash_attention_triton(qd, kd, vd, is_causal=causal),
                                attention_gluon=False),
        "gluon": (lambda: G.gluon_attention_fwd(qd, kd, vd, causal=causal, variant=gv))
        if G.gluon_supported(qd, kd, vd, causal) is None else None,
        "fa2": lambda: fa2(qd, kd, vd),
        "cudnn": lambda: cud(qd, kd, vd)}
    t = _time_set(fwd)
    for name, ms in t.items():
        row[f"fwd_{name}_tflops"] = round(flops / ms / 1e9, 1) if ms else None
    row["fwd_vs_cudnn"] = _ratio(row["fwd_fxopt_tflops"], row["fwd_cudnn_tflops"])
    row["fwd_vs_fa2"] = _ratio(row["fwd_fxopt_tflops"], row["fwd_fa2_tflops"])
    if FB_GRAPH:  # the op's forward and the anchors replayed from CUDA graphs (see FB_GRAPH)
        tg = _time_set({n: fwd[n] for n in ("fxopt", "cudnn")}, graph=True)
        for name, ms in tg.items():
            row[f"fwdg_{name}_tflops"] = round(flops / ms / 1e9, 1) if ms else None
        row["fwdg_vs_cudnn"] = _ratio(row["fwdg_fxopt_tflops"], row["fwdg_cudnn_tflops"])
    if bwd:
        fb = {"fxopt": _fwd_bwd(ours, q, k, v, do)}
        if routing.select("backward", (9, 0), d, causal, S, S) != routing.TRITON:  # the same, Triton backward
            fb["fxopt_tritonbwd"] = _with_kernels(_fwd_bwd(ours, q, k, v, do), attention_gluon_backward=False)
        fb.update(fa2=_fwd_bwd(fa2, q, k, v, do), cudnn=_fwd_bwd(cud, q, k, v, do))
        tb = _time_set(fb)
        for name, ms in tb.items():
            row[f"fb_{name}_tflops"] = round(3.5 * flops / ms / 1e9, 1) if ms else None
        row["fb_vs_cudnn"] = _ratio(row["fb_fxopt_tflops"], row["fb_cudnn_tflops"])
        row["fb_vs_fa2"] = _ratio(row["fb_fxopt_tflops"], row["fb_fa2_tflops"])
        if FB_GRAPH:  # the same calls replayed from CUDA graphs: GPU time only (see FB_GRAPH)
            tg = _time_set(fb, graph=True)
            for name, ms in tg.items():
                row[f"fbg_{name}_tflops"] = round(3.5 * flops / ms / 1e9, 1) if ms else None
            row["fbg_vs_cudnn"] = _ratio(row["fbg_fxopt_tflops"], row["fbg_cudnn_tflops"])
    # what "fxopt" ran (after the timing, so that a Gluon build that failed during it shows as fallen back)
    routes = A.kernel_routes(qd, kd, vd, is_causal=causal)
    row["fwd_kernel"], row["bwd_kernel"] = routes["forward"], routes["backward"] if bwd else None
    # the eager columns replay launch plans unless FXOPT_LAUNCH_PLANS=0 (earlier tables had none)
    row["launch_plans"] = "on" if LP.ENABLED else "off"
    if any("fell back" in str(r) for r in routes.values()):
        print(f"  WARNING: d={d} S={S} causal={causal}: {routes}", flush=True)
    # correctness of the timed kernel against SDPA on the same inputs
    ref = fa2(qd, kd, vd)
    row["max_err_vs_fa2"] = round((A.flash_attention_triton(qd, kd, vd, is_causal=causal) - ref).abs().max().item(),
                                  4)
    print(row, flush=True)
    return row


def decode_rows(S, B=8, H=32, d=128, hkv=None, combine=None):
    """One decode row. ``hkv``: key/value heads (GQA when < H); ``combine``: "fused" / "kernel" sets the split-KV
    combine for the fxopt calls (default: the library's rule)."""
    hkv = hkv or H
    fused = {"fused": True, "kernel": False}.get(combine)
    ours = lambda a, b, c: A.flash_attention_triton(a, b, c, decode_combine=fused)  # noqa: E731
    q = _rand(B, H, 1, d)
    k, v = _rand(B, hkv, S, d), _rand(B, hkv, S, d)
    nbytes = 2 * B * hkv * S * d * 2
    row = {"decode_S": S, "B": B, "H": H, "d": d}
    if hkv != H or combine is not None:
        row.update(Hkv=hkv, combine=combine or "auto")
    gqa = hkv != H
    sdpa = lambda backend: _sdpa_gqa(backend, q, k, v) if gqa else _sdpa(backend, q, k, v, False)  # noqa: E731
    t = _time_set({"fxopt": lambda: ours(q, k, v),
                   "fa2": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
                   "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION)})
    for name, ms in t.items():
        row[f"{name}_TBps"] = round(nbytes / ms / 1e9, 2) if ms else None
    row["vs_cudnn"] = _ratio(row["fxopt_TBps"], row["cudnn_TBps"])
    row["vs_fa2"] = _ratio(row["fxopt_TBps"], row["fa2_TBps"])
    # the same calls replayed from CUDA graphs (host launch overhead removed for both)
    tg = _time_set({"fxopt": lambda: ours(q, k, v),
                    "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION)}, graph=True)
    for name, ms in tg.items():
        row[f"graph_{name}_TBps"] = round(nbytes / ms / 1e9, 2) if ms else None
    row["graph_vs_cudnn"] = _ratio(row["graph_fxopt_TBps"], row["graph_cudnn_TBps"])
    # calls back to back in one CUDA graph, alternating between two K/V copies (each >= 10x L2), as the layers of a
    # decode step run: no L2 flush in front of each call. do_bench's flush (a 256 MB zero-fill) leaves dirty lines
    # that the timed call writes back (~12 us on the H200, docs/kernels.md)
    try:
        sets = [(q, k, v), (q, _rand(B, hkv, S, d), _rand(B, hkv, S, d))]
        calls = 24 if S <= 8192 else 8
        ts = {"fxopt": streamed_us(lambda it: ours(*it), sets, calls=calls),
              "cudnn": streamed_us(lambda it: (_sdpa_gqa(SDPBackend.CUDNN_ATTENTION, *it) if gqa else
                                               _sdpa(SDPBackend.CUDNN_ATTENTION, *it, False)), sets, calls=calls)}
        for name, us in ts.items():
            row[f"streamed_{name}_TBps"] = round(nbytes / us / 1e6, 2) if us else None
        row["streamed_vs_cudnn"] = _ratio(row["streamed_fxopt_TBps"], row["streamed_cudnn_TBps"])
        del sets
    except Exception as e:  # keep the row (and the table) when the streamed timing cannot run
        print(f"streamed decode timing failed: {type(e).__name__}: {e}", flush=True)
    ref = sdpa(SDPBackend.FLASH_ATTENTION) if not gqa else sdpa(SDPBackend.MATH)
    row["max_err_vs_fa2"] = round((ours(q, k, v) - ref).abs().max().item(), 4)
    print(row, flush=True)
    return row


# ----------------------------------------------------------------------------------------------------------------
def main():
    def extra(p):
        p.add_argument("--shapes", default=None,
                       help="only these rows, e.g. 128x1024,256x4096 (d x S; causal and not), no decode rows")

    args = parse_args(__doc__.splitlines()[0], extra=extra)
    torch.manual_seed(0)
    if args.quick:
        shapes = [(128, 4096, False), (128, 4096, True), (64, 4096, False), (128, 16384, True), (256, 4096, False),
                  (256, 8192, True)]
    else:  # d = 128 first, so that a time-out still leaves the headline rows
        BENCH.update(warmup=10, rep=50)
        shapes = [(d, S, c) for d in (128, 64, 256) for S in (512, 1024, 2048, 4096, 8192, 16384)
                  for c in (False, True)]
    if args.shapes:
        shapes = [(int(x.split("x")[0]), int(x.split("x")[1]), c) for x in args.shapes.split(",")
                  for c in (False, True)]
    name = "attention"
    rows = []
    t0 = time.time()
    for S in (() if args.shapes else (4096, 32768)):
        rows.append(decode_rows(S))
    for i, (d, S, c) in enumerate(shapes):
        rows.append(attention_rows(d, S, c))
        if i % 6 == 5:  # partial results survive a time-out
            write_results(name, rows, title="FlashAttention (partial: the run stopped here)", out_dir=args.out)
    notes = ("fxopt forward timed through `flash_attention_triton` (the kernel launch; on sm_90 at d = 128 it runs "
             "the Gluon FA3-style kernel, fxopt/kernels/attention/gluon_fwd.py); fwd_triton = the Triton-language "
             "kernel alone, fwd_gluon = the Gluon kernel alone (where it takes the inputs); fwd+bwd through "
             "`torch.ops.fxopt.flash_attention` + `torch.autograd.grad`; fwd_kernel / bwd_kernel = the kernels "
             "fxopt ran (`attention.kernel_routes`, read after the row's timing: a Gluon build that failed shows as "
             "fallen back). FA2 = SDPA FLASH_ATTENTION, cuDNN = SDPA "
             "CUDNN_ATTENTION, same inputs, same run. fwdg_* / fbg_* = the forward / fwd+bwd calls replayed from CUDA "
             "graphs (GPU time, no host launch path; the eager fwd_* / fb_* include what of it exceeds do_bench's L2 "
             "fill). Decode rows: TB/s = K+V bytes / time; graph_* = the same call "
             "replayed from a CUDA graph (no host launch overhead). Each row's candidates are timed in "
             f"{ROUNDS} interleaved rounds (each round a different stride through the candidates, "
             "`common.round_order`; triton.testing.do_bench medians, warmup "
             f"{BENCH['warmup']} ms, rep {max(10, BENCH['rep'] // max(1, ROUNDS))} ms per round), the median over "
             f"rounds reported. Wall time {time.time() - t0:.0f} s. "
             f"Routing table {routing.ROUTES_DIGEST}. "
             "FXOPT_ environment: " + (", ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                                if k.startswith("FXOPT_")) or "none") + ".")
    # the Triton tuners' picks (key -> config): at short S the Triton backward's fwd+bwd differed by up to 43%
    # between two runs of one shape, so the tables say which configs they timed
    picks = []
    for tname in ("_attn_fwd_tuned", "_attn_bwd_dkdv_tuned", "_attn_bwd_dq_tuned"):
        for key, cfg in getattr(getattr(launch, tname), "cache", {}).items():
            picks.append(f"{tname}[{', '.join(str(x) for x in key[:10])}] = {cfg}")
    if picks:
        notes += " Triton tuner picks: " + "; ".join(picks) + "."
    write_results(name, rows,
                  title="FlashAttention (bf16, 16k tokens/batch, hidden 2048; decode B=8 H=32 d=128)",
                  notes=notes, out_dir=args.out)


if __name__ == "__main__":
    main()
