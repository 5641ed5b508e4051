"""Persistent stream-K decode kernel (fxopt/kernels/attention_decode.py) vs the current split-KV path and cuDNN.

Rows: bf16, B = 8, H = Hkv = 32, d = 128, one query token, S in (4096, 32768); for each S the current path
(``torch.ops.fxopt.flash_attention``), SDPA cuDNN and the persistent kernel for ctas_per_sm in (1, 2, 3) and a few
(block_n, num_warps, num_stages, q_per_item) builds, all timed in the same run (median of triton.testing.do_bench).
TB/s = K+V bytes / time. max_err: against SDPA cuDNN (falls back to SDPA math if cuDNN is unavailable).
A build that does not fit ``ctas_per_sm`` CTAs per SM still runs (programs queue into a second wave); the resident
count of each build is in ``offline_report`` (``python -m fxopt.kernels.attention_decode 64,4,3``).

Without CUDA: a tiny smoke run of the kernel through the Triton interpreter, then exit (no timings).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, parse_args, write_results  # noqa: E402

import torch  # noqa: E402

# (block_n, num_warps, num_stages, q_per_item)
BUILDS = [(64, 4, 3, False), (64, 4, 3, True), (32, 4, 4, False), (64, 4, 2, False), (128, 4, 2, False),
          (64, 8, 3, False)]
QUICK_BUILDS = [(64, 4, 3, False)]


def _smoke():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from fxopt.kernels.attention_decode import decode_attention_persistent

    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    out, _ = decode_attention_persistent(q, k, v, block_n=16, num_programs=3)
    ref = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 4.0, -1) @ v.repeat_interleave(2, 1)
    print(f"needs CUDA for timings; interpreter smoke run max error {(out - ref).abs().max().item():.2e}")


def main():
    args = parse_args(__doc__.splitlines()[0], extra=lambda p: p.add_argument(
        "--seqs", default="4096,32768", help="comma-separated key lengths"))
    if not torch.cuda.is_available():
        _smoke()
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fxopt.kernels.ops  # noqa: F401  (registers torch.ops.fxopt.*)
    from fxopt.kernels.attention_decode import decode_attention_persistent

    B, H, d = 8, 32, 128
    builds = QUICK_BUILDS if args.quick else BUILDS
    cps_list = (2,) if args.quick else (1, 2, 3)
    rows = []
    for S in (int(s) for s in args.seqs.split(",")):
        torch.manual_seed(S)
        q = torch.randn(B, H, 1, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * k.numel() * k.element_size()
        tbps = lambda ms: round(nbytes / ms / 1e9, 3)  # noqa: E731

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)

        try:
            ref = cudnn()
            cudnn_ms = bench_ms(cudnn)
        except Exception as e:  # cuDNN unavailable for this build of torch
            print(f"  cuDNN: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            with sdpa_kernel(SDPBackend.MATH):
                ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(q.dtype)
            cudnn_ms = None
        cur = lambda: torch.ops.fxopt.flash_attention(q, k, v)  # noqa: E731
        cur_ms = bench_ms(cur)
        base = {"S": S, "B": B, "H": H, "d": d}
        rows.append({**base, "kernel": "fxopt split (current)", "TBps": tbps(cur_ms), "ms": round(cur_ms, 4),
                     "cudnn_TBps": tbps(cudnn_ms) if cudnn_ms else None,
                     "max_err": round((cur() - ref).abs().max().item(), 5)})
        print(rows[-1], flush=True)
        for bn, warps, stages, qpi in builds:
            for cps in cps_list:
                run = lambda: decode_attention_persistent(q, k, v, ctas_per_sm=cps, block_n=bn,  # noqa: E731
                                                          num_warps=warps, num_stages=stages, q_per_item=qpi)
                try:
                    err = (run()[0] - ref).abs().max().item()
                    ms = bench_ms(run)
                except Exception as e:  # a build this GPU rejects (e.g. out of shared memory)
                    print(f"  ({bn}, {warps}, {stages}, {qpi}) x {cps}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160] if str(e) else ''}", flush=True)
                    continue
                rows.append({**base, "kernel": "persistent", "block_n": bn, "warps": warps, "stages": stages,
                             "q_per_item": qpi, "ctas_per_sm": cps, "TBps": tbps(ms), "ms": round(ms, 4),
                             "cudnn_TBps": tbps(cudnn_ms) if cudnn_ms else None,
                             "vs_current": round(cur_ms / ms, 3), "max_err": round(err, 5)})
                print(rows[-1], flush=True)
        # the current path and cuDNN once more at the end of the S block: drift check for the same-run comparison
        rows.append({**base, "kernel": "fxopt split (again)", "TBps": tbps(bench_ms(cur)),
                     "cudnn_TBps": tbps(bench_ms(cudnn)) if cudnn_ms else None})
        print(rows[-1], flush=True)
    write_results("decode_persistent_quick" if args.quick else "decode_persistent", rows, out_dir=args.out,
                  title="Persistent stream-K decode vs split-KV and cuDNN (bf16, B=8, H=32, d=128, one query)",
                  notes="TB/s = K+V bytes / median do_bench time. persistent: P = SMs x ctas_per_sm programs, each "
                        "walking a contiguous range of (b*h, key block) pairs; vs_current = current ms / "
                        "persistent ms. max_err vs SDPA cuDNN.")


if __name__ == "__main__":
    main()
