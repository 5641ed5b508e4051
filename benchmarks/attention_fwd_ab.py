"""A/B of Gluon forward builds that differ by an import-time switch (one process per side), GPU time and bit identity.

Session 16: ``FXOPT_ATTN_GLUON_UNROLL2`` (``attention_gluon._UNROLL2_DIMS``), the persistent build's unmasked
key-block loop unrolled by two. Run the script once per setting with a different ``--label``; the first process
saves each row's out / lse under ``--ref``, later ones compare bit for bit. Each row: one Gluon build, 16k tokens
per batch, hidden 2048, bf16; TFLOP/s from 20 calls back to back in one CUDA graph (median of 20 replays), cuDNN
on the same inputs in the same process (the clock drift between processes shows in its column).

    python benchmarks/attention_fwd_ab.py --label rolled --ref /tmp/ab --out DIR
    FXOPT_ATTN_GLUON_UNROLL2=64,128 python benchmarks/attention_fwd_ab.py --label unrolled --ref /tmp/ab --out DIR
    FXOPT_ATTN_GLUON_CAST_LATE=1 python benchmarks/attention_fwd_ab.py --label castlate --ref /tmp/ab --out DIR
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, streamed_us, write_results  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fxopt.kernels import attention_gluon as G  # noqa: E402

# (head dim, variant, lengths): persistent3 is not unrolled (a control whose ratio should not move)
DEFAULT_ROWS = ((64, "persistent", (1024, 4096, 16384)), (64, "persistent3", (4096, 16384)),
                (128, "persistent", (512, 1024, 4096, 16384)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", required=True)
    p.add_argument("--ref", default="/tmp/fxopt_fwd_ab")
    p.add_argument("--out", default=RESULTS_DIR)
    args = p.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.makedirs(args.ref, exist_ok=True)
    rows = []
    for D, variant, lengths in DEFAULT_ROWS:
        for S in lengths:
            for causal in (False, True):
                B, H = 16384 // S, 2048 // D
                gen = torch.Generator(device="cuda").manual_seed(S * 1000 + D)
                q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(3))

                def run():
                    return G.gluon_attention_fwd(q, k, v, causal=causal, variant=variant)

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                out, lse = run()
                path = os.path.join(args.ref, f"{D}_{variant}_{S}_{int(causal)}.pt")
                same = ""
                if os.path.exists(path):
                    o_ref, l_ref = torch.load(path)
                    same = bool(torch.equal(out.cpu(), o_ref) and torch.equal(lse.cpu(), l_ref))
                else:
                    torch.save((out.cpu(), lse.cpu()), path)
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                us = streamed_us(lambda _: run(), [None], calls=20)
                us_cudnn = streamed_us(lambda _: cudnn(), [None], calls=20)
                rows.append({"label": args.label, "d": D, "variant": variant, "S": S, "causal": causal,
                             "gluon_tflops": flops / us / 1e6, "cudnn_tflops": flops / us_cudnn / 1e6,
                             "vs_cudnn": us_cudnn / us, "bit_identical_to_first": same})
    write_results(f"attention_fwd_ab_{args.label}", rows, out_dir=args.out,
                  title=f"Gluon forward build A/B: {args.label} (bf16, 16k tokens/batch, hidden 2048)",
                  notes=f"FXOPT_ATTN_GLUON_UNROLL2={os.environ.get('FXOPT_ATTN_GLUON_UNROLL2', '(unset: default)')}"
                        f" -> unrolled head dims {G._UNROLL2_DIMS}; FXOPT_ATTN_GLUON_CAST_LATE -> "
                        f"{G._CAST_LATE_ON}. gluon / cudnn TFLOP/s: 20 calls back to back "
                        "in one CUDA graph, median of 20 replays. bit_identical_to_first: out and lse equal to "
                        "those of the first process run with this --ref.")


if __name__ == "__main__":
    main()
