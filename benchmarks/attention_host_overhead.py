"""Host (CPU) time of the attention op's launch path, against SDPA's cuDNN backend (H200).

Session 13's per-kernel profile (``attention_breakdown.py``) found the op's fwd+bwd at S = 512 (d = 128, B = 32,
H = 16) spending 0.67-0.74 ms in kernels while ``attention.py`` timed 1.5-1.9 ms per call; cuDNN's kernel sum and
timing agree. A launch path slower than the GPU shows as exactly that. This script measures it directly:

* ``wall_us``: per call, 50 calls back to back then one synchronize, on a tiny shape (B = H = 1, S = 128), where
  the GPU work is a few microseconds, so the figure is the host's;
* a cProfile of 30 fwd+bwd calls of the op on the same shape: the functions with the most own time.

    python3 benchmarks/attention_host_overhead.py [--out DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_results  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from fxopt.kernels import attention as A  # noqa: E402


def wall_us(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


class _PlainFunction(torch.autograd.Function):
    """The op's fwd+bwd as a plain autograd.Function calling the kernel launchers directly (no custom-op dispatch):
    the A/B that says whether the host time is the custom op's autograd layer or the autograd engine."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        out, lse = A.flash_attention_triton(q, k, v, is_causal=causal, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*A.flash_attention_triton_bwd(dout, q, k, v, out, lse, is_causal=ctx.causal), None)


def thread_wall_us(fn, calls: int = 50) -> float:
    """wall_us with the calls made from a second Python thread (the autograd engine runs CUDA backward nodes on
    its own device thread)."""
    import threading

    res = []
    t = threading.Thread(target=lambda: res.append(wall_us(fn, calls)))
    t.start()
    t.join()
    return res[0]


def experiment(B, H, S, D, causal):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = A.flash_attention_triton(qd, kd, vd, is_causal=causal, return_lse=True)
    op = lambda a_, b_, c_: torch.ops.fxopt.flash_attention(a_, b_, c_, is_causal=causal)  # noqa: E731
    bwd = lambda: A.flash_attention_triton_bwd(do, qd, kd, vd, out, lse, is_causal=causal)  # noqa: E731

    def sdpa(a_, b_, c_):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(a_, b_, c_, is_causal=causal)

    cands = {
        "kernel bwd, main thread": bwd,
        "kernel bwd, second thread": None,
        "op bwd (torch.ops.fxopt.flash_attention_bwd)": lambda: torch.ops.fxopt.flash_attention_bwd(
            do, qd, kd, vd, out, lse, None, 0.0, causal, None, -1, 0.0, None, None),
        "op fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(op(q, k, v), (q, k, v), do),
        "plain Function fwd+bwd": lambda: torch.autograd.grad(_PlainFunction.apply(q, k, v, causal), (q, k, v), do),
        "cudnn fwd+bwd": lambda: torch.autograd.grad(sdpa(q, k, v), (q, k, v), do),
    }
    rows = []
    for name, fn in cands.items():
        us = thread_wall_us(bwd) if fn is None else wall_us(fn)
        rows.append({"shape": f"{B}x{H}x{S}x{D}", "causal": causal, "call": name, "wall_us": round(us, 1)})
        print(f"[experiment] {B}x{H}x{S}x{D} causal={causal} {name}: {us:.1f} us per call", flush=True)
    return rows


def layout_ab(B=1, H=1, S=128, D=128, rounds=3):
    """Host time of the Gluon forward and backward launches with ``attention_gluon.host_layout`` cached (as shipped)
    and uncached (NVMMASharedLayout.get_default_for per descriptor, as before session 13), interleaved rounds."""
    import functools

    from fxopt.kernels import attention_gluon as G
    from fxopt.kernels import attention_gluon_bwd as GB
    from fxopt.kernels.attention_gluon_bwd_dqw import gluon_attention_bwd_dqw

    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = A.flash_attention_triton(q, k, v, return_lse=True)
    cached = G.host_layout
    uncached = cached.__wrapped__
    fns = {"gluon fwd launch": lambda: G.gluon_attention_fwd(q, k, v, variant=A._gluon_fwd_variant(D, False, S)),
           "gluon bwd launch (variant 6)": functools.partial(gluon_attention_bwd_dqw, do, q, k, v, out, lse, tma=True)}
    rows = []
    for name, fn in fns.items():
        got = {"cached": [], "uncached": []}
        for _ in range(rounds):
            for mode, lay in (("cached", cached), ("uncached", uncached)):
                G.host_layout = GB.host_layout = lay
                try:
                    got[mode].append(wall_us(fn, 200))
                finally:
                    G.host_layout = GB.host_layout = cached
        for mode, vals in got.items():
            rows.append({"call": name, "layouts": mode, "wall_us": round(sorted(vals)[len(vals) // 2], 1)})
            print(f"[layout_ab] {name} {mode}: {sorted(vals)[len(vals) // 2]:.1f} us per call (rounds {vals})",
                  flush=True)
    return rows


def _setup(B, H, S, D, causal):
    """Inputs (leaf q / k / v, their detached views, dO, out / lse of the forward) and the cuDNN / op callables."""
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = A.flash_attention_triton(qd, kd, vd, is_causal=causal, return_lse=True)

    def sdpa(a_, b_, c_):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(a_, b_, c_, is_causal=causal)

    def op(a_, b_, c_):
        return torch.ops.fxopt.flash_attention(a_, b_, c_, is_causal=causal)

    return q, k, v, do, qd, kd, vd, out, lse, sdpa, op


def plans_ab(shapes, rounds=3):
    """Host-bound wall time per call with launch plans (``fxopt.kernels.launch_plan``, the default) and without,
    interleaved rounds; cuDNN in the same run. At S = 512 the GPU work is 0.3-0.7 ms, so the fwd+bwd rows there are
    what attention.py's eager columns see."""
    from fxopt.kernels import launch_plan as LP

    rows = []
    for B, H, S, D in shapes:
        for causal in (False, True):
            q, k, v, do, qd, kd, vd, out, lse, sdpa, op = _setup(B, H, S, D, causal)
            cands = {
                "kernel fwd": lambda: A.flash_attention_triton(qd, kd, vd, is_causal=causal, return_lse=True),
                "kernel bwd": lambda: A.flash_attention_triton_bwd(do, qd, kd, vd, out, lse, is_causal=causal),
                "op fwd+bwd": lambda: torch.autograd.grad(op(q, k, v), (q, k, v), do),
                "cudnn fwd+bwd": lambda: torch.autograd.grad(sdpa(q, k, v), (q, k, v), do),
            }
            routes = str(A.kernel_routes(qd, kd, vd, is_causal=causal))
            for name, fn in cands.items():
                got = {"on": [], "off": []}
                for _ in range(rounds):
                    for mode in ("on", "off"):
                        LP.ENABLED = mode == "on"
                        LP.clear_plans()
                        try:
                            got[mode].append(wall_us(fn, 100))
                        finally:
                            LP.ENABLED = True
                    if name.startswith("cudnn"):
                        got.pop("off")
                        got["off"] = got["on"]
                        break
                med = {m: sorted(x)[len(x) // 2] for m, x in got.items()}
                rows.append({"shape": f"{B}x{H}x{S}x{D}", "causal": causal, "call": name,
                             "plans_on_us": round(med["on"], 1),
                             "plans_off_us": None if name.startswith("cudnn") else round(med["off"], 1),
                             "routes": routes if name.startswith("op") else ""})
                print(f"[plans_ab] {B}x{H}x{S}x{D} causal={causal} {name}: on {med['on']:.1f} off {med['off']:.1f} "
                      f"us per call", flush=True)
    print("plan stats:", LP.stats, flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--shape", default="1x1x128x128", help="BxHxSxD")
    p.add_argument("--experiment", action="store_true", help="only the thread / plain-Function A/B")
    p.add_argument("--layout-ab", action="store_true", help="only the cached / uncached descriptor-layout A/B")
    p.add_argument("--plans-ab", default=None, metavar="SHAPES",
                   help="only the launch-plan A/B, at these comma-separated BxHxSxD shapes")
    a = p.parse_args()
    B, H, S, D = (int(x) for x in a.shape.split("x"))
    if a.plans_ab:
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in a.plans_ab.split(",")]
        write_results("attention_host_plans_ab", plans_ab(shapes), out_dir=a.out, echo=True,
                      title="Attention: host time per call with launch plans on / off",
                      notes="wall_us: 100 calls back to back, one synchronize, per call; median of 3 interleaved "
                            "rounds (plans cleared before each). plans_on: the default (fxopt.kernels.launch_plan: "
                            "the second call of a key is recorded, later ones replay); cuDNN has no off column.")
        return
    if a.layout_ab:
        write_results("attention_host_layout_ab", layout_ab(B, H, S, D), out_dir=a.out, echo=True,
                      title="Gluon launches: host time with cached / uncached descriptor layouts",
                      notes=f"Shape {a.shape}, bf16; wall_us: 200 calls back to back, one synchronize, per call; "
                            "median of 3 interleaved rounds.")
        return
    if a.experiment:
        rows = []
        for shape in ((B, H, S, D), (32, 16, 512, 128)):
            for causal in (False, True):
                rows += experiment(*shape, causal)
        write_results("attention_host_experiment", rows, out_dir=a.out, echo=True,
                      title="Attention op: where the host time goes (threads, custom op, autograd)",
                      notes="wall_us: 50 calls back to back then one synchronize, per call; at 32x16x512x128 the GPU "
                            "work is ~0.6-0.75 ms per fwd+bwd, so a figure above that is host-bound.")
        return
    rows = []
    for causal in (False, True):
        q, k, v, do, qd, kd, vd, out, lse, sdpa, op = _setup(B, H, S, D, causal)
        cands = {
            "kernel fwd (flash_attention_triton)": lambda: A.flash_attention_triton(qd, kd, vd, is_causal=causal),
            "kernel bwd (flash_attention_triton_bwd)": lambda: A.flash_attention_triton_bwd(
                do, qd, kd, vd, out, lse, is_causal=causal),
            "op fwd, no grad": lambda: op(qd, kd, vd),
            "op fwd, grad graph": lambda: op(q, k, v),
            "op fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(op(q, k, v), (q, k, v), do),
            "cudnn fwd, no grad": lambda: sdpa(qd, kd, vd),
            "cudnn fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(sdpa(q, k, v), (q, k, v), do),
        }
        for name, fn in cands.items():
            us = wall_us(fn)
            rows.append({"causal": causal, "call": name, "wall_us": round(us, 1),
                         "routes": str(A.kernel_routes(qd, kd, vd, is_causal=causal)) if "op" in name else ""})
            print(f"causal={causal} {name}: {us:.1f} us per call", flush=True)
        if not causal:
            # torch.ops.fxopt.flash_attention in eager runs a plain autograd.Function over the launchers (session 13,
            # attention._EagerFlashAttention); with attention._EAGER_FUNCTION off it runs the custom ops
            # flash_attention_fwd / _bwd, as traced graphs do
            fb = lambda: torch.autograd.grad(op(q, k, v), (q, k, v), do)  # noqa: E731
            saved = A._EAGER_FUNCTION
            try:
                A._EAGER_FUNCTION = False
                rows.append({"causal": causal, "call": "op fwd+bwd through the custom ops (as traced graphs)",
                             "wall_us": round(wall_us(fb), 1), "routes": ""})
            finally:
                A._EAGER_FUNCTION = saved
            for label, eager_fn in (("custom ops", False), ("eager Function", True)):
                A._EAGER_FUNCTION = eager_fn
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(30):
                    fb()
                torch.cuda.synchronize()
                prof.disable()
                A._EAGER_FUNCTION = saved
                for key in ("tottime", "cumulative"):
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(28)
                    print(f"[profile {label}, by {key}]\n" + s.getvalue()[:9000], flush=True)
            # torch.profiler sees what cProfile cannot: time inside C (driver calls such as cuLaunchKernelEx and
            # cuTensorMapEncodeTiled, aten ops, allocator) per fwd+bwd of the eager path
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                for _ in range(30):
                    fb()
                torch.cuda.synchronize()
            print("[torch.profiler eager Function, by self CPU time]\n"
                  + tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)[:9000], flush=True)
    write_results("attention_host_overhead", rows, out_dir=a.out, echo=True,
                  title="Attention op: host time per call (tiny shape, GPU work negligible)",
                  notes=f"Shape B x H x S x D = {a.shape}, bf16. wall_us: 50 calls back to back, one synchronize, "
                        "per call. routes: the kernels the op runs (attention.kernel_routes).")


if __name__ == "__main__":
    main()
