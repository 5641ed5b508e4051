"""Pipeline parallelism: bubble, throughput and the cost model's stage times.

Two GPUs (training step, 2 stages, 1F1B, M ∈ {1, 2, 4, 8, 16} micro-batches)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/pipeline_parallel.py [--out DIR]

For every M: step time, tokens/s against the same step on one GPU (the whole model compiled with fxopt on rank 0),
the measured bubble ``1 - M * t_slowest_stage / t_step`` (``t_slowest_stage``: fwd+bwd of one micro-batch on the
slowest stage, timed alone) against the ideal ``(p - 1) / (M + p - 1)``, and the predicted against the measured
forward time of each stage. Part ``training`` (``training_cuda_graphs`` with ``--cuda-graphs``) of
``pipeline_parallel.{json,md}``. ``--smoke-cpu`` (gloo, tiny model) writes to a temporary directory unless ``--out``
is given.

One GPU (cost model check, < 2 min)::

    python benchmarks/pipeline_parallel.py --single-gpu [--stages 4] [--no-compile]

captures the model, splits it with the pipeline pass (H200 profile calibrated by one matmul and one copy), and times
every stage's forward on one micro-batch alone, eager and compiled with fxopt: predicted vs measured per stage, and
the measured balance against the predicted one. Part ``cost_model`` of ``pipeline_parallel.{json,md}``.

``NCCL_NVLS_ENABLE=0`` is set here (NVLink multicast is not used by point-to-point sends and must stay off on the
shared machines).
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, parse_args, write_results  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _extra(p):
    p.add_argument("--single-gpu", action="store_true", help="cost model vs stage times measured one by one")
    p.add_argument("--stages", type=int, default=4, help="stages for --single-gpu")
    p.add_argument("--no-compile", action="store_true", help="--single-gpu: eager stage times only")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--split-points", nargs="*", default=[], help="--single-gpu: pinned split points (module names)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="two-GPU run: fxopt.pipeline(..., cuda_graphs=True), stages replayed from CUDA graphs")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="check the torchrun path without GPUs: gloo, a tiny model, fp32, backend fxopt_eager")


def _model(args, device, dtype=torch.bfloat16):
    from fxopt.models import TinyLlamaConfig, build_demo_model

    cfg = TinyLlamaConfig(vocab_size=32000, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 128,
                          n_kv_heads=max(1, args.dim // 512), ffn_dim=int(args.dim * 8 / 3) // 64 * 64,
                          max_seq_len=args.seq)
    return build_demo_model(0, cfg).to(device=device, dtype=dtype).train()


def _lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def single_gpu(args):
    from fxopt.parallel.pipeline import _state_names, build_stage_modules, capture
    from fxopt.passes.manager import ensure_meta_val
    from fxopt.passes.pipeline import DeviceProfile, build_plan

    dev = torch.device("cuda")
    t0 = time.time()
    model = _model(args, dev)
    mb = max(1, args.batch // 4)
    ids = torch.randint(0, 32000, (mb, args.seq), device=dev)
    gm, ex = capture(model, [ids], {})
    ensure_meta_val(gm, ex)
    names = _state_names(model)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state = {n.name: names[id(v)] for n, v in zip(phs, ex) if id(v) in names}
    tensors = {names[id(v)]: v for v in ex if id(v) in names}
    profile = DeviceProfile.measure(dev)
    plan = build_plan(gm, args.stages, state=state, profile=profile, split_points=args.split_points)
    print(plan)
    mods = build_stage_modules(gm, plan, state, tensors, [n.name for n in phs if n.name not in state])
    rows = []
    with torch.no_grad():
        # Every stage's input, then every compile and first call (autotuning) before any timing: a stage timed
        # right after the process's first compile (compile workers starting, GPU idle for seconds) can read slow.
        ins, h = [], (ids,)
        for s in range(args.stages):
            ins.append(h)
            out = mods[s](*h)
            h = out if isinstance(out, tuple) else (out,)
        cms, kernels = {}, {}
        if not args.no_compile:
            from torch._inductor import metrics

            for s in range(args.stages):
                metrics.reset()
                cms[s] = torch.compile(mods[s], backend="fxopt", dynamic=False)
                cms[s](*ins[s])
                kernels[s] = metrics.generated_kernel_count
            torch.cuda.synchronize()
        for s in range(args.stages):
            m, inp = mods[s], ins[s]
            row = {"stage": s, "modules": f"{plan.stages[s].modules[0]}..{plan.stages[s].modules[1]}",
                   "predicted_us": plan.stages[s].seconds * 1e6, "eager_us": bench_ms(lambda: m(*inp)) * 1e3}
            if s in cms:
                cm = cms[s]
                row["compiled_us"] = bench_ms(lambda: cm(*inp)) * 1e3
                row["triton_kernels"] = kernels[s]
            rows.append(row)
        for row in reversed(rows):  # a second pass, in reverse order: a time that depends on when it ran is not the stage's
            s = row["stage"]
            if s in cms:
                cm, inp = cms[s], ins[s]
                row["compiled_us_2nd"] = bench_ms(lambda: cm(*inp)) * 1e3
            row["pred/eager"] = row["predicted_us"] / row["eager_us"]
            if "compiled_us" in row:
                row["pred/compiled"] = row["predicted_us"] / min(row["compiled_us"], row["compiled_us_2nd"])
    for key in ("eager_us", "compiled_us", "compiled_us_2nd"):
        if key in rows[0]:
            t = [r[key] for r in rows]
            print(f"measured balance ({key}): {max(t) / (sum(t) / len(t)):.3f}; predicted {plan.balance:.3f}")
    notes = (f"Model: demo Llama dim {args.dim}, {args.layers} layers, seq {args.seq}, micro-batch {mb}, bf16, "
             f"forward only. Cost model profile: {profile.name} (matmul {profile.matmul_peak(torch.bfloat16) / 1e12:.0f} "
             f"TFLOP/s, {profile.mem_bw / 1e9:.0f} GB/s). Predicted balance {plan.balance:.3f}. "
             f"Wall time {time.time() - t0:.0f} s.\n\n```\n{plan}\n```")
    write_results("pipeline_parallel", rows, part="cost_model", notes=notes, out_dir=args.out,
                  title="Pipeline cost model: predicted vs measured stage times")


def two_gpus(args):
    import torch.distributed as dist

    from fxopt.parallel.pipeline import pipeline

    smoke = args.smoke_cpu
    if smoke:
        dist.init_process_group("gloo")
        dev = torch.device("cpu")
        args.dim, args.layers, args.seq, args.batch = 128, 4, 32, min(args.batch, 16)
        backend = "fxopt_eager"
    else:
        dist.init_process_group("nccl")
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        torch.cuda.set_device(dev)
        backend = "fxopt"
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if not smoke else (lambda: None)
    t_start = time.time()
    model = _model(args, dev, torch.float32 if smoke else torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (args.batch, args.seq), generator=g).to(dev)
    tgt = torch.randint(0, 32000, (args.batch, args.seq), generator=g).to(dev)
    tokens = args.batch * args.seq

    def timed(fn, reps=5):
        fn()
        fn()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        dist.barrier()
        return (time.perf_counter() - t0) / reps

    def gpu_idle(fn):
        """Fraction of one step's GPU window (first kernel start to last kernel end) in which no compute kernel runs:
        the bubble as the GPU sees it. NCCL kernels count as idle (a stage waiting in a receive does no work)."""
        if smoke:
            return None
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        sync()
        dist.barrier()
        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                sync()
            kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            if not kernels:
                return None
            lo = min(e.time_range.start for e in kernels)
            hi = max(e.time_range.end for e in kernels)
            busy, end = 0.0, lo
            for a, b in sorted((e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()):
                a = max(a, end)
                if b > a:
                    busy += b - a
                    end = b
            return 1.0 - busy / max(hi - lo, 1e-9)
        except Exception as e:  # the profiler is a measurement aid: the other columns stand without it
            print(f"rank {rank}: GPU-idle measurement failed: {type(e).__name__}: {e}")
            return None
        finally:
            dist.barrier()

    # One GPU: the whole model, compiled with fxopt, same batch (rank 0; the other rank waits).
    single_s = None
    if rank == 0:
        cm = torch.compile(model, backend=backend)

        def one_gpu_step():
            _lm_loss(cm(ids), tgt).backward()

        one_gpu_step()
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            one_gpu_step()
        sync()
        single_s = (time.perf_counter() - t0) / 5
        model.zero_grad(set_to_none=True)
    dist.barrier()
    box = [single_s]
    dist.broadcast_object_list(box, src=0)
    single_s = box[0]

    rows = []
    ms = [1, 2, 4] if args.quick else [1, 2, 4, 8, 16]
    for m in ms:
        runner = pipeline(model, (ids,), stages=world, microbatches=m, schedule="1F1B", loss_fn=_lm_loss,
                          device=dev, compile=backend, cuda_graphs=args.cuda_graphs and not smoke)
        step_s = timed(lambda: runner.step(ids, target=tgt if runner.is_last else None))
        idle = gpu_idle(lambda: runner.step(ids, target=tgt if runner.is_last else None))
        idles = [None] * world
        dist.all_gather_object(idles, idle)
        # Each rank's stage alone: fwd and fwd+bwd of one micro-batch.
        mb_ids = ids.chunk(m)[0]
        stage = runner._compiled[runner.stage_indices[0]]
        if rank == 0:
            x_in = (mb_ids,)
        else:
            prev = runner.plan.boundaries[-1].values
            x_in = tuple(torch.randn(shape, device=dev, dtype=dt, requires_grad=dt.is_floating_point)
                         for _, shape, dt in prev)
        with torch.no_grad():
            fwd_ms = bench_ms(lambda: stage(*x_in))

        def fwd_bwd():
            out = stage(*x_in)
            out = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward([o for o in out if o.requires_grad],
                                    [torch.ones_like(o) for o in out if o.requires_grad])

        fb_ms = bench_ms(fwd_bwd)
        for p in runner.parameters():
            p.grad = None
        gathered = [None] * world
        dist.all_gather_object(gathered, (fwd_ms, fb_ms))
        slowest = max(g[1] for g in gathered) / 1e3
        p = world
        row = {"microbatches": m, "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s,
               "speedup_vs_1gpu": single_s / step_s, "bubble_measured": max(0.0, 1 - m * slowest / step_s),
               "bubble_ideal": (p - 1) / (m + p - 1)}
        for s in range(world):
            row[f"stage{s}_gpu_idle"] = idles[s] if idles[s] is not None else ""
        for s in range(world):
            row[f"stage{s}_fwd_pred_us"] = runner.plan.stages[s].seconds * 1e6
            row[f"stage{s}_fwd_meas_us"] = gathered[s][0] * 1e3
        if args.cuda_graphs:
            states = [None] * world
            dist.all_gather_object(states, runner.cuda_graphs)
            row["cuda_graphs"] = "; ".join(f"stage {k}: {v}" for st in states for k, v in st.items())
        rows.append(row)
        if rank == 0:
            print(runner.plan)
            print(row)
    if rank == 0:
        notes = (("CPU SMOKE RUN (gloo, tiny fp32 model, fxopt_eager): checks the code path, not a measurement. "
                  if smoke else "") + f"2 stages on {world} GPUs, 1F1B, demo Llama dim {args.dim}, {args.layers} layers, batch {args.batch} x "
                 f"seq {args.seq}, bf16, stages compiled with backend='fxopt'"
                 f"{', replayed from CUDA graphs (cuda_graphs=True)' if args.cuda_graphs else ''}. "
                 f"One-GPU step: {single_s * 1e3:.1f} ms. "
                 "bubble_measured = 1 - M * (fwd+bwd of one micro-batch on the slowest stage, alone) / step time. "
                 "stageN_gpu_idle = the share of one profiled step's GPU window (first to last kernel) in which "
                 "rank N runs no compute kernel (NCCL kernels count as idle): the bubble as that GPU sees it, "
                 "host gaps included. "
                 f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}. Wall time {time.time() - t_start:.0f} s.")
        write_results("pipeline_parallel", rows, part="training_cuda_graphs" if args.cuda_graphs else "training",
                      title="Pipeline parallel training step (2 stages)", notes=notes, out_dir=args.out)
    dist.destroy_process_group()


def main():
    args = parse_args("pipeline parallel benchmark", _extra, smoke=lambda a: a.smoke_cpu)
    if args.single_gpu:
        single_gpu(args)
    else:
        two_gpus(args)


if __name__ == "__main__":
    main()
