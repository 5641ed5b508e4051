"""Tensor parallelism: fxopt.parallelize (plan found in the graph) vs one GPU vs a hand-written DTensor plan.

Two GPUs (prefill and decode of a Llama-style model built from 8B-sized blocks, bf16)::

    NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py [--layers 4]

  Rows: one GPU (full model, ``torch.compile(backend="fxopt")``, timed on rank 0 before the group is used), fxopt TP=2
  (``fxopt.parallelize`` then ``torch.compile(backend="fxopt")``), DTensor TP=2 (``parallelize_module`` with
  ColwiseParallel q/k/v/gate/up and RowwiseParallel o/down, local head counts patched as torchtitan does, then
  ``torch.compile``). Decode = one new token per sequence without a KV cache (the step is weight-bandwidth bound,
  which is where TP pays off); prefill = one sequence of ``--seq`` tokens.

One GPU, no second rank (``--local-compute``): each rank's *local compute* against the full model's. Rank 0's graph
is built with a fake process group of world size ``--tp`` (its collectives do nothing), so the time is what rank 0
computes, without communication; the ideal is 1/tp of the full model's time::

    PYTHONUNBUFFERED=1 python benchmarks/tensor_parallel.py --local-compute --out $OUT

``NCCL_NVLS_ENABLE=0`` is set by default (NVLink SHARP multicast is not available to these jobs).
"""
from __future__ import annotations

import copy
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import bench_ms, parse_args, write_results  # noqa: E402

import fxopt  # noqa: E402
from fxopt.models import TinyLlama, TinyLlamaConfig  # noqa: E402
from fxopt.parallel.tensor_parallel import parallelize  # noqa: E402


def _args(p):
    p.add_argument("--layers", type=int, default=None, help="decoder blocks (default 4; 2 with --local-compute)")
    p.add_argument("--seq", type=int, default=2048, help="prefill length")
    p.add_argument("--decode-batch", type=int, default=8, help="sequences per decode step")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--local-compute", action="store_true", help="one GPU: rank 0's local compute vs the full model")
    p.add_argument("--no-dtensor", action="store_true")


def build(layers: int, device) -> TinyLlama:
    """Llama-3-8B-sized blocks: dim 4096, 32 q heads, 8 kv heads, SwiGLU 14336, vocab 32000 (bf16, std 0.02)."""
    cfg = TinyLlamaConfig(vocab_size=32000, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                          max_seq_len=4096, sdpa=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyLlama(cfg)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
        from fxopt.models import rotary_tables
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
        model.cos.copy_(cos)
        model.sin.copy_(sin)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def inputs(args, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    prefill = torch.randint(0, 32000, (1, args.seq), generator=g).to(device)
    decode = torch.randint(0, 32000, (args.decode_batch, 1), generator=g).to(device)
    return {"prefill": prefill, "decode": decode}


def compiled_timings(module, ins) -> dict:
    fn = torch.compile(module, backend="fxopt")
    out = {}
    with torch.no_grad():
        for name, x in ins.items():
            module(x)  # eager once: a new shape re-captures outside the compiled region (fxopt.parallelize)
            fn(x)
            out[name] = bench_ms(lambda: fn(x))
    return out


def dtensor_model(model, tp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (tp,))
    m = copy.deepcopy(model)
    for blk in m.layers:
        parallelize_module(blk, mesh, {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                                       "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                                       "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                       "mlp.down_proj": RowwiseParallel()})
        blk.attn.n_heads //= tp  # local head counts, as hand-written plans must patch them
        blk.attn.n_kv_heads //= tp
    return m


def run_local_compute(args):
    device = torch.device("cuda")
    layers = args.layers or 2
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=args.tp, store=FakeStore())
    model = build(layers, device)
    ins = inputs(args, device)
    t0 = time.perf_counter()
    full = compiled_timings(model, ins)
    tpm = parallelize(model, (ins["prefill"],), tp=args.tp)
    local = compiled_timings(tpm, ins)
    print(tpm.plan)
    rows = []
    for name in ins:
        rows.append({"phase": name, "shape": tuple(ins[name].shape), "layers": layers, "tp": args.tp,
                     "full_model_ms": full[name], "rank0_local_ms": local[name],
                     "local/full": local[name] / full[name], "ideal": 1.0 / args.tp})
    write_results("tensor_parallel_local_compute", rows, out_dir=args.out,
                  title=f"TP={args.tp}: rank 0's local compute vs the full model (one GPU, no communication)",
                  notes=f"Llama-3-8B-sized blocks, bf16, fxopt backend; rank 0's graph built with a fake process "
                        f"group (collectives are no-ops). Wall time of the whole run "
                        f"{time.perf_counter() - t0:.0f} s.")
    dist.destroy_process_group()


def run_tp(args):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    layers = args.layers or 4
    model = build(layers, device)
    ins = inputs(args, device)
    single = compiled_timings(model, ins) if rank == 0 else {}
    dist.barrier()
    tpm = parallelize(model, (ins["prefill"],), tp=world)
    with torch.no_grad():
        ref = model(ins["prefill"])
        err = (tpm(ins["prefill"]).float() - ref.float()).abs().max().item()
    fx_t = compiled_timings(tpm, ins)
    dt_t = {}
    if not args.no_dtensor:
        dt_t = compiled_timings(dtensor_model(model, world), ins)
    if rank == 0:
        print(tpm.plan)
        rows = []
        for name in ins:
            row = {"phase": name, "shape": tuple(ins[name].shape), "layers": layers,
                   "one_gpu_ms": single[name], f"fxopt_tp{world}_ms": fx_t[name]}
            if dt_t:
                row[f"dtensor_tp{world}_ms"] = dt_t[name]
            row["speedup_vs_one_gpu"] = single[name] / fx_t[name]
            rows.append(row)
        write_results("tensor_parallel", rows, out_dir=args.out,
                      title=f"Tensor parallel TP={world}: fxopt.parallelize vs one GPU vs DTensor",
                      notes=f"Llama-3-8B-sized blocks, bf16. max |fxopt TP - one GPU| on prefill logits: {err:.3g}. "
                            f"all_reduces per forward: {tpm.plan.all_reduces}.")
    dist.destroy_process_group()


def main():
    args = parse_args(__doc__.splitlines()[0], _args)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/tensor_parallel.py needs CUDA")
    if args.local_compute:
        run_local_compute(args)
    else:
        run_tp(args)


if __name__ == "__main__":
    main()
