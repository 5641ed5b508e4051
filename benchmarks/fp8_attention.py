"""FP8 attention forward speed on the H200 vs cuDNN bf16 and SDPA flash (FA2) bf16, measured in the same run.

16k tokens per batch (B = 16384 / S), hidden 2048 (H = 2048 / d), d in {128, 64}, S = 1k ... 16k, causal and not.
TFLOP/s = 4 * B * H * S^2 * d / time (halved for causal). Columns:

* ``fp8_kernel``: the Triton attention kernel alone on pre-quantized inputs (Q, K block-quantized after the Hadamard
  transform, V transposed) - what FA3 reports for its FP8 kernel.
* ``gluon_fp8_kernel``: the Gluon (warp-specialized, FA3-style) fp8 kernel on the same inputs; where it takes the
  shape (sm_90, d 64 / 128) the op runs it (``fxopt.kernels.fp8.ops.fp8_build``), so ``op_kernel`` = the one of
  the two that the op actually uses and ``quant_ms`` = op - op_kernel.
* ``fp8_op``: ``torch.ops.fxopt.fp8_attention`` end to end (Hadamard + quantization of Q, K, V + attention).
* ``cudnn_bf16`` / ``fa2_bf16``: ``F.scaled_dot_product_attention`` forced to cuDNN / flash via ``sdpa_kernel``.
* ``check``: relative L2 error of the fp8 op vs the emulating reference at that shape's first 512 queries (S = 1k
  rows only), so every autotuned choice is also checked.

* ``quant_*`` (non-causal rows): Q, K, V quantization alone, us and TB/s counting 16-bit reads + e4m3 writes.
  ``quant_fused``: ``quantize_qkv``, one launch of the persistent ``_quant_qkv_kernel`` (what the op runs);
  ``quant_tc`` / ``quant_butterfly``: three per-tensor ``_quant_kernel`` launches (its fallback), tensor-core /
  butterfly transform.

Writes ``results/fp8_attention.{md,json}`` (after every row, so a time-out keeps the rows done).

    python benchmarks/fp8_attention.py [--quick] [--dims 128,64] --out $OUT   # about 2 minutes on an H200
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as Fn

from common import bench_ms, parse_args, write_results  # noqa: I001

from fxopt.kernels import fp8 as F
from fxopt.kernels.fp8 import gluon_fwd as G
from fxopt.kernels.fp8.ops import fp8_build
from fxopt.kernels.fp8.triton_fwd import SUM_CHUNK


def tflops(b, h, s, d, causal, ms):
    flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return flops / (ms * 1e-3) / 1e12


def sdpa_ms(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    try:
        with sdpa_kernel([be]):
            Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return bench_ms(lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=causal))
    except RuntimeError as e:  # backend unavailable for this shape
        print(f"{backend}: {e}")
        return float("nan")


def quant_columns(q, k, v) -> dict:
    """Q, K, V quantization alone: the fused launch, and three per-tensor launches with the tensor-core and the
    butterfly transform (us, TB/s counting 16-bit reads + e4m3 writes)."""
    nbytes = (q.numel() + k.numel() + v.numel()) * (q.element_size() + 1)

    def per_tensor(tensor_core):
        def run():
            kw = dict(fused=False, tensor_core=tensor_core)
            F.quantize_blocks(q, hadamard=True, seed=0, **kw)
            F.quantize_blocks(k, hadamard=True, seed=0, **kw)
            F.quantize_blocks(v, hadamard=False, transpose=True, **kw)
        return run

    out = {}
    for tag, fn in (("quant_fused", lambda: F.quantize_qkv(q, k, v, hadamard=True, seed=0)),
                    ("quant_tc", per_tensor(True)), ("quant_butterfly", per_tensor(False))):
        fn()
        t = bench_ms(fn)
        out[f"{tag}_us"] = t * 1e3
        out[f"{tag}_TBps"] = nbytes / (t * 1e-3) / 1e12
    return out


def main():
    args = parse_args(__doc__.splitlines()[0], extra=lambda p: (p.add_argument("--dims", default="128,64")))
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    t0 = time.time()
    dims = [int(x) for x in args.dims.split(",")]
    seqs = [1024, 4096] if args.quick else [4096, 16384, 8192, 1024, 2048]
    rows = []
    notes = ("TFLOP/s (higher is better); fp8_kernel (Triton) and gluon_fp8_kernel exclude quantization (FA3's "
             "convention), fp8_op includes the Hadamard transform and block quantization of Q, K, V and runs "
             "op_kernel; quant_ms = op time - op_kernel time. int8_kernel: the INT8 mode of the same kernel "
             "(Q, K, V transformed, P at 255 levels; fxopt::int8_attention), quantization excluded. quant_*: Q, K, V "
             "quantization alone (fused = one launch, tc / butterfly = three per-tensor launches). Anchors measured "
             "in the same process.")
    for d in dims:
        for s in seqs:
            b, h = 16384 // s, 2048 // d
            g = torch.Generator(device="cuda").manual_seed(s + d)
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            for causal in (False, True):
                row = {"d": d, "S": s, "B": b, "H": h, "causal": causal}
                qq, qs = F.quantize_blocks(q, hadamard=True, seed=0)
                kq, ks = F.quantize_blocks(k, hadamard=True, seed=0)
                vt, vs = F.quantize_blocks(v, hadamard=False, transpose=True)
                out = torch.empty_like(q)

                def kernel():
                    return F.fp8_attention_quantized(qq, qs, kq, ks, vt, vs, shape_q=q.shape, seq_k=s, n_kv_heads=h,
                                                     out_dtype=q.dtype, is_causal=causal, out=out)

                def op():
                    return torch.ops.fxopt.fp8_attention(q, k, v, causal, None, True, 0)

                gluon_ok = fp8_build(q, k, v, causal, None, out) == "gluon"

                def gluon_kernel():
                    return G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, shape_q=q.shape, seq_k=s,
                                                           n_kv_heads=h, out_dtype=q.dtype, is_causal=causal, out=out)

                iq, iqs = F.quantize_blocks(q, hadamard=True, seed=0, qdtype=torch.int8)
                ik, iks = F.quantize_blocks(k, hadamard=True, seed=0, qdtype=torch.int8)
                ivt, ivs, ivsum = F.quantize_blocks(v, hadamard=True, seed=0, transpose=True, qdtype=torch.int8,
                                                    sum_chunk=SUM_CHUNK)
                signs = F.hadamard_signs(d, 0, q.device)

                def int8_kernel():
                    return F.fp8_attention_quantized(iq, iqs, ik, iks, ivt, ivs, shape_q=q.shape, seq_k=s,
                                                     n_kv_heads=h, out_dtype=q.dtype, is_causal=causal, out=out,
                                                     vsum=ivsum, signs=signs)

                kernel()
                op()
                int8_kernel()
                if gluon_ok:
                    gluon_kernel()
                ms = {"fp8_kernel": bench_ms(kernel),
                      "gluon_fp8_kernel": bench_ms(gluon_kernel) if gluon_ok else float("nan"),
                      "fp8_op": bench_ms(op), "int8_kernel": bench_ms(int8_kernel),
                      "cudnn_bf16": sdpa_ms(q, k, v, causal, "cudnn"), "fa2_bf16": sdpa_ms(q, k, v, causal, "flash")}
                for name, t in ms.items():
                    row[name] = tflops(b, h, s, d, causal, t)
                row["fp8_kernel/cudnn"] = row["fp8_kernel"] / row["cudnn_bf16"]
                row["gluon_fp8_kernel/cudnn"] = row["gluon_fp8_kernel"] / row["cudnn_bf16"]
                row["fp8_op/cudnn"] = row["fp8_op"] / row["cudnn_bf16"]
                row["int8_kernel/cudnn"] = row["int8_kernel"] / row["cudnn_bf16"]
                if s == 1024:
                    sl = (slice(0, 1), slice(0, 2))
                    o = op()[sl]
                    emu = F.fp8_attention_reference(q[sl], k[sl], v[sl], is_causal=causal, hadamard=True, seed=0)
                    row["check"] = ((o.float() - emu.float()).norm() / emu.float().norm()).item()
                    o8 = torch.ops.fxopt.int8_attention(q[sl], k[sl], v[sl], causal, None, 0)
                    emu8 = F.int8_attention_reference(q[sl], k[sl], v[sl], is_causal=causal, seed=0)
                    row["int8_check"] = ((o8.float() - emu8.float()).norm() / emu8.float().norm()).item()
                row["op_kernel"] = "gluon" if gluon_ok else "triton"
                row["quant_ms"] = ms["fp8_op"] - ms["gluon_fp8_kernel" if gluon_ok else "fp8_kernel"]
                if not causal:
                    row.update(quant_columns(q, k, v))
                rows.append(row)
                print(row, f"[{time.time() - t0:.0f}s]", flush=True)
                write_results("fp8_attention", rows, title="FP8 attention forward (H200), TFLOP/s", notes=notes,
                              out_dir=args.out)
            del q, k, v, qq, kq, vt, iq, ik, ivt
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
