"""Calibration speed and memory of ``fxopt.quantize`` (GPTQ, AWQ, RTN) on a randomly initialized Llama-style model.

The model is :class:`fxopt.models.TinyLlama` built from Llama-3-8B-sized blocks (dim 4096, 32 query / 8 KV heads,
SwiGLU 14336, vocab 32000; std-0.02 random weights, bf16 on CUDA, fp32 on CPU). The default 8 layers give about
2.0B parameters (1.75B in the blocks, 0.26B in embedding + head). Calibration: ``--cal-samples`` sequences of
``--seq`` random tokens (default 128 x 512 = 65,536 tokens, the usual GPTQ/AWQ setting). Each method quantizes a
fresh copy of the model (``pack=True``: real :class:`~fxopt.quant.linear.QuantLinear` modules are installed).

Columns: ``wall_s`` = wall time of ``fxopt.quantize`` (Dynamo capture, probes, sweep and install included, CUDA
synchronized); ``s_per_linear`` = wall_s / quantized linears; ``peak_gib`` = ``torch.cuda.max_memory_allocated``
during the call, with the float model already resident; ``model_gib`` = the float model's parameter bytes;
``peak/model`` their ratio (1.0 would mean no calibration overhead at all); ``layer_err_vs_rtn`` = mean over linears
of ``tr(ΔW H ΔWᵀ)`` of the method over RTN's for the same inputs (on random weights and random tokens, so only a
sanity figure: real-weight quality is ``benchmarks/quant_quality.py``). On CPU, peak memory is not measured.

Usage (H200)::

    PYTHONUNBUFFERED=1 python benchmarks/calibration_speed.py --out $OUT [--layers 8] [--methods gptq awq rtn]

CPU smoke run: ``python benchmarks/calibration_speed.py --device cpu --dim 128 --layers 2 --cal-samples 4 --seq 64
--out /tmp/calspeed``.
"""
from __future__ import annotations

import copy
import gc
import sys
import time

import torch

from common import parse_args, write_results

from fxopt.models import TinyLlama, TinyLlamaConfig, rotary_tables
from fxopt.quant.calibrate import QuantizeReport, quantize


def _args(p):
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (smoke runs with small sizes)")
    p.add_argument("--dtype", default=None, help="bfloat16 / float16 / float32 (default bf16 on cuda, fp32 on cpu)")
    p.add_argument("--layers", type=int, default=8, help="decoder blocks (8 -> ~2.0B parameters at dim 4096)")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=None, help="SwiGLU width (default 3.5 x dim up to a multiple of 256)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default dim / 128, at least 2)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default heads / 4, at least 1)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--cal-samples", type=int, default=128)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--methods", nargs="*", default=["rtn", "gptq", "awq"],
                   help="rtn, gptq, awq, and the quality settings of benchmarks/quant_quality.py: "
                        "gptq-ft (mse, static groups, float target) and awq-ft (float target)")
    p.add_argument("--offload", action="store_true", help="keep calibration activations on the CPU")


def build(args, device, dtype) -> TinyLlama:
    heads = args.heads or max(2, args.dim // 128)
    kv = args.kv_heads or max(1, heads // 4)
    ffn = args.ffn or -(-int(3.5 * args.dim) // 256) * 256  # 3.5 x dim rounded up to 256: 14336 at dim 4096
    cfg = TinyLlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=heads, n_kv_heads=kv,
                          ffn_dim=ffn, max_seq_len=max(args.seq, 16), sdpa=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyLlama(cfg)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
        model.cos.copy_(cos)
        model.sin.copy_(sin)
    return model.to(dtype).eval().requires_grad_(False), cfg


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


METHODS = {
    "rtn": dict(method="rtn"),
    "gptq": dict(method="gptq"),
    "awq": dict(method="awq"),
    "gptq-ft": dict(method="gptq", act_order=True, static_groups=True, mse=True, float_target=True),
    "awq-ft": dict(method="awq", float_target=True),
}


def main():
    args = parse_args(__doc__.splitlines()[0], _args, smoke=lambda a: a.device == "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/calibration_speed.py measures on CUDA; for a CPU smoke run pass "
                 "--device cpu --dim 128 --layers 2 --cal-samples 4 --seq 64")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    t0 = time.perf_counter()
    base, cfg = build(args, device, dtype)
    n_params = sum(p.numel() for p in base.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    print(f"model: {args.layers} layers, dim {cfg.dim}, ffn {cfg.ffn_dim}, heads {cfg.n_heads}/{cfg.n_kv_heads}, "
          f"{n_params / 1e9:.2f}B params, {model_bytes / 2**30:.2f} GiB {dtype} on {device} "
          f"(built in {time.perf_counter() - t0:.1f}s)", flush=True)
    g = torch.Generator().manual_seed(1)
    cal = [torch.randint(0, cfg.vocab_size, (1, args.seq), generator=g).to(device) for _ in range(args.cal_samples)]
    rows = []
    for method in args.methods:
        model = copy.deepcopy(base)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        rep = QuantizeReport()
        print(f"[{method}] start ({args.cal_samples} x {args.seq} tokens)", flush=True)
        _sync(device)
        t = time.perf_counter()
        quantize(model, cal, group_size=args.group_size, offload=args.offload, report=rep, progress=True,
                 **METHODS[method])
        _sync(device)
        wall = time.perf_counter() - t
        n_lin = len(rep.rows) or sum(1 for m in model.modules() if type(m).__name__ == "QuantLinear")
        ratios = [r["err_vs_rtn"] for r in rep.rows]
        row = {"method": method, "layers": args.layers, "params_b": n_params / 1e9, "dtype": str(dtype)[6:],
               "cal_tokens": 0 if method == "rtn" else args.cal_samples * args.seq, "linears": n_lin,
               "wall_s": wall, "s_per_linear": wall / max(n_lin, 1),
               "layer_err_vs_rtn": sum(ratios) / len(ratios) if ratios else None}
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            row.update(peak_gib=peak / 2**30, model_gib=model_bytes / 2**30, **{"peak/model": peak / model_bytes})
        rows.append(row)
        print(f"[{method}] {wall:.1f}s, {row['s_per_linear']:.3f} s/linear"
              + (f", peak {row['peak_gib']:.1f} GiB (model {row['model_gib']:.1f} GiB)" if "peak_gib" in row else "")
              + (f", layer err vs rtn {row['layer_err_vs_rtn']:.3f}" if ratios else ""), flush=True)
        del model
        gc.collect()
        # written after every method, so a run cut short by a time limit keeps the rows it finished
        write_results("calibration_speed", rows, title="fxopt.quantize calibration speed and memory (random Llama-style)",
                      out_dir=args.out, notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
