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

Both write ``results/tensor_parallel.{md,json}``, each its own part: ``tp`` (torchrun) and ``local_compute``.
``--smoke-cpu`` (gloo, tiny model) writes to a temporary directory unless ``--out`` is given.

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

from common import bench_ms_fixed, parse_args, write_results  # noqa: E402

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
    p.add_argument("--vocab-parallel", action="store_true",
                   help="also cut the lm_head by vocabulary (fxopt: vocab_parallel=True; DTensor: ColwiseParallel)")
    p.add_argument("--vocab-parallel-embedding", action="store_true",
                   help="fxopt: also cut the (untied) embedding by vocabulary rows (one more all-reduce)")
    p.add_argument("--variants", default="one,fxopt,dtensor",
                   help="comma-separated subset of one (one GPU), fxopt (fxopt TP), dtensor (DTensor TP); the DTensor "
                        "variant's Inductor compile took over 3 minutes on the two-H200 machine, so it can run alone")
    p.add_argument("--skip-one-gpu", action="store_true", help="same as leaving 'one' out of --variants")
    p.add_argument("--overlap-chunks", type=int, default=1,
                   help="fxopt TP: cut each row-parallel all-reduce into this many token chunks (overlap)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="fxopt TP: reduce-scatter / all-gather over the tokens instead of all-reduce (inference)")
    p.add_argument("--async-tp", action="store_true",
                   help="with --sequence-parallel: Inductor's micro-pipeline TP (all-gather -> matmul and matmul -> "
                        "reduce-scatter overlapped through symmetric memory); experimental")
    p.add_argument("--one-shot-ar", action="store_true",
                   help="Inductor lowers all-reduces of <= 128 KB (decode) to symmetric-memory one-shot all-reduces "
                        "(config._collective.auto_select); experimental")
    p.add_argument("--no-cudagraphs", action="store_true", help="skip the mode='reduce-overhead' decode rows")
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of a decode step (rank 0)")
    p.add_argument("--profile-phase", default="decode", choices=["decode", "prefill"],
                   help="the phase --profile runs (also with --local-compute)")
    p.add_argument("--backend", default=None,
                   help="torch.compile backend (default fxopt; fxopt_eager in --smoke-cpu runs, which skip Inductor)")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="check the torchrun path without GPUs: gloo, a tiny model, backend fxopt_eager")


VOCAB = 32000


def build(layers: int, device, small: bool = False) -> TinyLlama:
    """Llama-3-8B-sized blocks: dim 4096, 32 q heads, 8 kv heads, SwiGLU 14336, vocab 32000 (bf16, std 0.02).

    ``small``: dim 256, 4 q heads, 2 kv heads, SwiGLU 512 (CPU smoke runs).
    """
    if small:
        cfg = TinyLlamaConfig(vocab_size=VOCAB, dim=256, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=512,
                              max_seq_len=256, sdpa=True)
    else:
        cfg = TinyLlamaConfig(vocab_size=VOCAB, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, ffn_dim=14336,
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
    return model.to(torch.float32 if small else torch.bfloat16).eval().requires_grad_(False)


def inputs(args, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    prefill = torch.randint(0, 32000, (1, args.seq), generator=g).to(device)
    decode = torch.randint(0, 32000, (args.decode_batch, 1), generator=g).to(device)
    return {"prefill": prefill, "decode": decode}


BACKEND = "fxopt"


PROFILE_PHASE = "decode"
ITERS = 100


def compiled_timings(module, ins, mode=None, label: str = "", rank: int = 0, profile: bool = False) -> dict:
    """Median ms per phase of ``torch.compile(module, backend="fxopt", mode=mode)``.

    ``profile``: then 10 compiled steps of ``PROFILE_PHASE`` run under the profiler (on every rank: the TP graph holds
    collectives) and rank 0 prints the top CUDA kernels.
    """
    torch._dynamo.reset()  # each variant compiles afresh (no cache hit across the one-GPU / TP / DTensor modules)
    if mode == "reduce-overhead":
        # Fresh CUDA-graph trees on every rank: rank 0 alone ran the one-GPU variant's graphs, and a rank that records
        # its collectives while the other still warms up eagerly would wait forever (one TP run hung here).
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    fn = torch.compile(module, backend=BACKEND, mode=mode)
    out = {}
    with torch.no_grad():
        for name, x in ins.items():
            module(x)  # eager once: a new shape re-captures outside the compiled region (fxopt.parallelize)
            for _ in range(3):  # CUDA graphs record on the second or third call
                fn(x)
            # a fixed call count on every rank (the TP and DTensor graphs hold collectives)
            out[name] = bench_ms_fixed(lambda: fn(x), warmup=10, iters=ITERS)
            if rank == 0:
                print(f"timing: {label} mode={mode} {name}: {out[name]:.3f} ms", flush=True)
        if profile and torch.cuda.is_available():
            from torch.profiler import ProfilerActivity, profile as torch_profile

            x = ins[PROFILE_PHASE]
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn(x)
                torch.cuda.synchronize()
            if rank == 0:
                print(f"== profile of 10 compiled {PROFILE_PHASE} steps: {label}")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    return out


def cudagraph_timings(module, ins, label, rank=0) -> dict:
    """Decode with ``mode="reduce-overhead"`` (Inductor CUDA graphs): a step this small is bound by kernel launches."""
    try:
        return compiled_timings(module, {"decode": ins["decode"]}, mode="reduce-overhead", label=label, rank=rank)
    except Exception as e:  # reported in the table, not fatal: the other rows stand
        print(f"{label}: reduce-overhead failed: {type(e).__name__}: {str(e)[:300]}")
        return {}


def dtensor_model(model, tp: int, device_type: str = "cuda", vocab_parallel: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device_type, (tp,))
    m = copy.deepcopy(model)
    for blk in m.layers:
        parallelize_module(blk, mesh, {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                                       "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                                       "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                       "mlp.down_proj": RowwiseParallel()})
        blk.attn.n_heads //= tp  # local head counts, as hand-written plans must patch them
        blk.attn.n_kv_heads //= tp
    if vocab_parallel:
        parallelize_module(m, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return m


def run_local_compute(args):
    device = torch.device("cuda")
    layers = args.layers or 2
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=args.tp, store=FakeStore())
    model = build(layers, device)
    ins = inputs(args, device)
    t0 = time.perf_counter()
    full = compiled_timings(model, ins, label="full model", profile=args.profile)
    tpm = parallelize(model, (ins["prefill"],), tp=args.tp, vocab_parallel=args.vocab_parallel,
                      vocab_parallel_embedding=args.vocab_parallel_embedding)
    local = compiled_timings(tpm, ins, label="rank 0 local", profile=args.profile)
    print(tpm.plan)
    rows = []
    for name in ins:
        rows.append({"phase": name, "shape": tuple(ins[name].shape), "layers": layers, "tp": args.tp,
                     "full_model_ms": full[name], "rank0_local_ms": local[name],
                     "local/full": local[name] / full[name], "ideal": 1.0 / args.tp})
    write_results("tensor_parallel", rows, part="local_compute", out_dir=args.out,
                  title=f"TP={args.tp}: rank 0's local compute vs the full model (one GPU, no communication)",
                  notes=f"Llama-3-8B-sized blocks, bf16, fxopt backend; rank 0's graph built with a fake process "
                        f"group (collectives are no-ops). Wall time of the whole run "
                        f"{time.perf_counter() - t0:.0f} s.")
    dist.destroy_process_group()


def run_tp(args):
    global BACKEND, ITERS
    smoke = args.smoke_cpu
    if smoke:
        BACKEND = "fxopt_eager"
        ITERS = 5
    if args.backend:
        BACKEND = args.backend
    if smoke:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cpu")
        args.seq, args.decode_batch = min(args.seq, 64), min(args.decode_batch, 2)
    else:
        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    layers = args.layers or 4
    hang_s = float(os.environ.get("FXOPT_HANG_DUMP_S", "0"))
    if hang_s > 0:  # every thread's Python stack, every hang_s seconds, to find where a rank waits
        import faulthandler

        os.makedirs(args.out, exist_ok=True)
        stacks = open(os.path.join(args.out, f"stacks_rank{rank}.txt"), "w")
        faulthandler.dump_traceback_later(hang_s, repeat=True, file=stacks)
    t0 = time.perf_counter()
    model = build(layers, device, small=smoke)
    ins = inputs(args, device)
    n_full = sum(p.numel() for p in model.parameters())
    prof = args.profile and not smoke
    cg = not (smoke or args.no_cudagraphs)
    variants = set(args.variants.split(","))
    unknown = variants - {"one", "fxopt", "dtensor"}
    if unknown:
        sys.exit(f"unknown --variants {sorted(unknown)}")
    one = rank == 0 and "one" in variants and not args.skip_one_gpu
    single = compiled_timings(model, ins, label="one GPU", profile=prof) if one else {}
    single_cg = cudagraph_timings(model, ins, "one GPU") if one and cg else {}
    dist.barrier()
    if (args.async_tp or args.one_shot_ar) and not smoke:
        # Inductor's micro-pipeline TP pass fuses all_gather -> mm and mm -> reduce_scatter into overlapped
        # symmetric-memory ops; auto_select lowers small all-reduces to one-shot symmetric-memory kernels. Both
        # need symmetric memory on the group.
        import torch._inductor.config as inductor_config
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        inductor_config._micro_pipeline_tp = bool(args.async_tp)
        inductor_config._collective.auto_select = bool(args.one_shot_ar)
        enable_symm_mem_for_group(dist.group.WORLD.group_name)
    tpm = parallelize(model, (ins["prefill"],), tp=world, vocab_parallel=args.vocab_parallel,
                      overlap_chunks=args.overlap_chunks, vocab_parallel_embedding=args.vocab_parallel_embedding,
                      sequence_parallel=args.sequence_parallel or args.async_tp)
    n_local = sum(p.numel() for p in tpm.parameters()) + sum(b.numel() for b in tpm.buffers())
    with torch.no_grad():
        ref = model(ins["prefill"])
        err = (tpm(ins["prefill"]).float() - ref.float()).abs().max().item()
        ref_scale = ref.float().abs().max().item()
    fx_t = compiled_timings(tpm, ins, label=f"fxopt TP={world}", rank=rank, profile=prof) if "fxopt" in variants else {}
    fx_cg = cudagraph_timings(tpm, ins, f"fxopt TP={world}", rank) if cg and fx_t else {}
    dt_t = {}
    if "dtensor" in variants and not args.no_dtensor:
        dt_model = dtensor_model(model, world, device.type, args.vocab_parallel)
        with torch.no_grad():
            dt_err = (dt_model(ins["prefill"]).float() - ref.float()).abs().max().item()
        dt_t = compiled_timings(dt_model, ins, label=f"DTensor TP={world}", rank=rank)
    if rank == 0:
        print(tpm.plan)
        rows = []
        for name in ins:
            row = {"phase": name, "shape": tuple(ins[name].shape), "layers": layers,
                   "one_gpu_ms": single.get(name, ""), f"fxopt_tp{world}_ms": fx_t.get(name, ""),
                   f"dtensor_tp{world}_ms": dt_t.get(name, "")}
            row["speedup_vs_one_gpu"] = single[name] / fx_t[name] if single and fx_t else ""
            row["speedup_vs_dtensor"] = dt_t[name] / fx_t[name] if dt_t and fx_t else ""
            rows.append(row)
        if single_cg.get("decode") and fx_cg.get("decode"):
            rows.append({"phase": "decode, CUDA graphs (mode=reduce-overhead)", "shape": tuple(ins["decode"].shape),
                         "layers": layers, "one_gpu_ms": single_cg["decode"],
                         f"fxopt_tp{world}_ms": fx_cg["decode"],
                         "speedup_vs_one_gpu": single_cg["decode"] / fx_cg["decode"]})
        notes = (f"Llama-3-8B-sized blocks (dim 4096, 32/8 heads, SwiGLU 14336, vocab 32000), bf16, every variant "
                 f"compiled with backend='fxopt'. lm_head cut by vocabulary: {args.vocab_parallel} (fxopt "
                 f"vocab_parallel; DTensor ColwiseParallel with replicated output); embedding cut by vocabulary "
                 f"(fxopt): {args.vocab_parallel and args.vocab_parallel_embedding}; overlap_chunks "
                 f"{args.overlap_chunks}; sequence_parallel {args.sequence_parallel or args.async_tp}; async TP "
                 f"(Inductor micro-pipeline) {args.async_tp}; one-shot symmetric-memory all-reduces "
                 f"{args.one_shot_ar}. Parameters on rank 0: {n_local / 1e6:.0f}M of {n_full / 1e6:.0f}M "
                 f"({n_local / n_full:.1%}). max |fxopt TP - one GPU| on prefill logits: {err:.3g} "
                 f"(logits up to {ref_scale:.3g})")
        if dt_t:
            notes += f"; DTensor: {dt_err:.3g}"
        notes += (f". all_reduces per forward: {tpm.plan.all_reduces}. NCCL_NVLS_ENABLE="
                  f"{os.environ.get('NCCL_NVLS_ENABLE')}. Wall time {time.perf_counter() - t0:.0f} s.")
        if smoke:
            notes = "CPU SMOKE RUN (gloo, tiny model, fxopt_eager): checks the code path, not a measurement. " + notes
        write_results("tensor_parallel", rows, part="tp", out_dir=args.out,
                      title=f"Tensor parallel TP={world}: fxopt.parallelize vs one GPU vs DTensor", notes=notes)
    dist.barrier()
    if smoke:
        dist.destroy_process_group()
    else:
        # On the H200s destroy_process_group() never returned once CUDA graphs held NCCL work (Python stacks of both
        # ranks): the table is written and every rank is past the barrier, so leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main():
    global PROFILE_PHASE
    args = parse_args(__doc__.splitlines()[0], _args, smoke=lambda a: a.smoke_cpu)
    PROFILE_PHASE = args.profile_phase
    if not torch.cuda.is_available() and not args.smoke_cpu:
        sys.exit("benchmarks/tensor_parallel.py needs CUDA (or --smoke-cpu)")
    if args.local_compute:
        run_local_compute(args)
    else:
        run_tp(args)


if __name__ == "__main__":
    main()
