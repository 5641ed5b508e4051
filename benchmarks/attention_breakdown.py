"""Per-kernel GPU time of one attention fwd+bwd (torch.profiler), fxopt against cuDNN / FA2, same inputs.

Where the fwd+bwd TFLOP/s of ``benchmarks/attention.py`` is short of cuDNN (S < 4096: 0.3-0.65x in session 13), the
question is which launches the time goes to: the main backward kernel(s), or the small ones around them (delta
preprocess, the fp32 dQ accumulator's zero-fill and conversion, the forward). This script answers it per row:

    python3 benchmarks/attention_breakdown.py --shapes 128x512,128x1024 [--causal 0,1] [--out DIR]

Each candidate runs ``--iters`` fwd+bwd calls under the profiler after a warm-up (autotuning done by then); a row
lists every kernel with its mean microseconds per call and its share, plus the profiler's sum per call. Rows: bf16,
16k tokens per batch, hidden 2048 (the benchmark's shapes). ``--bwd`` selects the op's backward: ``route`` (what it
routes to), ``triton`` (Gluon backward off), ``gluon`` (floor lifted to 0).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_results  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from fxopt.kernels import attention as A  # noqa: E402


def _kernel_times(fn, iters: int) -> tuple[dict, float]:
    """({kernel name: us per call}, summed us per call) of fn() under torch.profiler (CUDA activity only)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            per[ev.name] += ev.device_time / iters
    return dict(per), sum(per.values())


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def rows_for(d: int, S: int, causal: bool, iters: int, bwd: str) -> list[dict]:
    B, H = 16384 // S, 2048 // d
    flops = 3.5 * 4 * B * H * S * S * d / (2 if causal else 1)
    q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def fb(f):
        return lambda: torch.autograd.grad(f(q, k, v), (q, k, v), do)

    def sdpa(backend):
        def f(a, b, c):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(a, b, c, is_causal=causal)
        return f

    cands = {"fxopt": fb(lambda a, b, c: torch.ops.fxopt.flash_attention(a, b, c, is_causal=causal)),
             "cudnn": fb(sdpa(SDPBackend.CUDNN_ATTENTION)), "fa2": fb(sdpa(SDPBackend.FLASH_ATTENTION))}
    rows = []
    for name, fn in cands.items():
        saved = (A._GLUON_BWD_HEAD_DIMS, A._GLUON_BWD_MIN_SEQ, dict(A._GLUON_BWD_MIN_SEQ_BY_DIM))
        if name == "fxopt" and bwd == "triton":
            A._GLUON_BWD_HEAD_DIMS = ()
        elif name == "fxopt" and bwd == "gluon":
            A._GLUON_BWD_MIN_SEQ, A._GLUON_BWD_MIN_SEQ_BY_DIM = 0, {}
        try:
            per, total = _kernel_times(fn, iters)
            routes = A.kernel_routes(q.detach(), k.detach(), v.detach(), is_causal=causal) if name == "fxopt" else {}
        finally:
            A._GLUON_BWD_HEAD_DIMS, A._GLUON_BWD_MIN_SEQ = saved[0], saved[1]
            A._GLUON_BWD_MIN_SEQ_BY_DIM = saved[2]
        label = f"{name} ({routes['forward']} / {routes['backward']})" if routes else name
        print(f"d={d} S={S} causal={causal} {label}: {total:.1f} us per fwd+bwd = "
              f"{flops / total / 1e6:.0f} TFLOP/s", flush=True)
        for kname, us in sorted(per.items(), key=lambda kv: -kv[1]):
            rows.append({"d": d, "S": S, "causal": causal, "impl": label, "kernel": _short(kname),
                         "us_per_call": round(us, 1), "share": round(us / total, 3),
                         "impl_total_us": round(total, 1), "impl_tflops": round(flops / total / 1e6, 1)})
            print(f"    {us:9.1f} us  {us / total:6.1%}  {_short(kname, 110)}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="128x512,128x1024")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--bwd", default="route", choices=["route", "triton", "gluon"])
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for shape in a.shapes.split(","):
        d, S = (int(x) for x in shape.split("x"))
        for c in a.causal.split(","):
            rows += rows_for(d, S, bool(int(c)), a.iters, a.bwd)
    write_results("attention_breakdown" + (f"_{a.tag}" if a.tag else ""), rows, out_dir=a.out, echo=False,
                  title="Attention fwd+bwd: GPU time per kernel (torch.profiler), fxopt vs cuDNN / FA2",
                  notes="us_per_call: the kernel's summed device time over the profiled calls / calls. impl_total_us:"
                        " the sum over the row's kernels (launch gaps not included). bf16, 16k tokens per batch, "
                        f"hidden 2048. fxopt backward selection: {a.bwd}.")


if __name__ == "__main__":
    main()
