"""``python -m fxopt demo`` (console script ``fxopt demo``): the embedded decoder, eager vs ``backend="fxopt"``.

Prints the passes applied with their counts, the max abs error against eager, the median latency of both and the
weight memory. ``--quant rtn`` also runs the model with its linears quantized to W4A16 (round-to-nearest, group 128),
eager-dequantized vs the fused kernels; ``--device cuda`` where a GPU is present (default: cuda if available).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _median_ms(fn, device: str, iters: int) -> float:
    fn()
    fn()  # warm-up (compilation, autotuning)
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _weight_bytes(model: torch.nn.Module) -> int:
    first: dict = {}  # tied tensors counted once
    for t in list(model.parameters()) + list(model.buffers()):
        first.setdefault(t.data_ptr(), t.numel() * t.element_size())
    return sum(first.values())


def _run_one(label, model, ids, device, iters, out):
    import fxopt

    with torch.no_grad():
        ref = model(ids)
        backend = fxopt.Backend()
        compiled = torch.compile(model, backend=backend)
        got = compiled(ids)
        err = (got.float() - ref.float()).abs().max().item()
        t_eager = _median_ms(lambda: model(ids), device, iters)
        t_fx = _median_ms(lambda: compiled(ids), device, iters)
    counts: dict = {}
    for results in backend.results:
        for r in results:
            counts[r.name] = counts.get(r.name, 0) + r.rewrites
    passes = ", ".join(f"{k} {v}" for k, v in counts.items()) or "no pass registered"
    print(f"\n[{label}]", file=out)
    print(f"  passes applied     : {passes}  ({len(backend.results)} graph(s))", file=out)
    print(f"  max |fxopt - eager|: {err:.3e}  (logits max |{ref.abs().max().item():.3f}|)", file=out)
    print(f"  median latency     : eager {t_eager:.2f} ms, fxopt {t_fx:.2f} ms ({t_eager / t_fx:.2f}x)", file=out)
    print(f"  weight memory      : {_weight_bytes(model) / 2**20:.2f} MiB", file=out)
    return err


def demo(argv=None, out=sys.stdout) -> int:
    from .models import TinyLlamaConfig, build_demo_model

    p = argparse.ArgumentParser(prog="fxopt demo", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--hand-written-attention", action="store_true", help="attention as matmul/softmax, not SDPA")
    p.add_argument("--quant", default="rtn", choices=["none", "rtn"],
                   help="also run a W4A16 (RTN, group 128) copy of the model (default: rtn)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is available")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    cfg = TinyLlamaConfig(n_layers=args.layers, sdpa=not args.hand_written_attention,
                          max_seq_len=max(512, args.seq))
    model = build_demo_model(seed=0, cfg=cfg).to(args.device, dtype)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"fxopt demo: TinyLlama ({cfg.n_layers} layers, dim {cfg.dim}, heads {cfg.n_heads}/{cfg.n_kv_heads} kv), "
          f"batch {args.batch} x seq {args.seq}, {dev_name}, {dtype}, torch {torch.__version__}", file=out)
    _run_one("float model", model, ids, args.device, args.iters, out)
    if args.quant == "rtn":
        from .quant.linear import QuantLinear, replace_linears

        qdtype = dtype if dtype != torch.float32 else torch.bfloat16  # W4A16 takes 16-bit activations
        qmodel = build_demo_model(seed=0, cfg=cfg).to(args.device, qdtype)
        replace_linears(qmodel, lambda name, lin: QuantLinear.from_linear(lin, group_size=128)
                        if lin.in_features % 128 == 0 else None)
        _run_one(f"w4a16 model (RTN g128, {qdtype})", qmodel, ids, args.device, args.iters, out)
    torch._dynamo.reset()
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fxopt demo [options]   (fxopt demo --help for the options)")
        return 0 if argv else 2
    if argv[0] == "demo":
        return demo(argv[1:])
    print(f"fxopt: unknown command {argv[0]!r}; available: demo", file=sys.stderr)
    return 2
