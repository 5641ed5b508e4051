"""3D parallelism (``fxopt.distribute``): plans at large meshes, one-GPU rows, and timed runs at the meshes a machine
allows, on a Llama-3-8B-shaped model (dim 4096, 32 q / 8 kv heads, SwiGLU 14336; ``--layers`` blocks, bf16).

Plans only (fake process group, nothing communicates; also on a CPU machine)::

    python benchmarks/distributed.py --plan --layers 4 --meshes 1x2x2,2x2x2,2x4x8 --out $OUT

  Per mesh (dp x pp x tp): layers per stage, tp collectives per layer, bytes each rank sends per step on tp / pp / dp,
  the predicted training bubble of each schedule at ``--microbatches`` (fxopt.parallel.schedules) and the one
  ``schedule="auto"`` picks.

One GPU (``--one-gpu``): prefill tokens/s and a training step's time of the full model, ``backend="fxopt"``.

Several GPUs (``torchrun --nproc-per-node N benchmarks/distributed.py --mesh 1x2x2``): the same rows for fxopt's
mesh, and with pp = 1 the hand-written DTensor plan (``parallelize_module``, Colwise q/k/v/gate/up, Rowwise o/down)
in the same run. ``--smoke-cpu`` checks this path on gloo with a small model (results to a temporary directory
unless ``--out`` is given).

All modes write ``results/distributed.{md,json}``, each its own part: ``plan``, ``one_gpu``, ``mesh <dp x pp x tp>``.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import parse_args, write_results  # noqa: E402
from tensor_parallel import build, dtensor_model  # noqa: E402

import fxopt  # noqa: E402
from fxopt.parallel.distribute import distribute  # noqa: E402
from fxopt.parallel.schedules import choose_schedule  # noqa: E402


def _args(p):
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--plan", action="store_true", help="plans on the fake process group, no run")
    p.add_argument("--meshes", default="1x2x2,2x2x2,1x4x8,2x4x8", help="dp x pp x tp meshes for --plan")
    p.add_argument("--one-gpu", action="store_true", help="time the full model on this device")
    p.add_argument("--mesh", default=None, help="dp x pp x tp of a torchrun run")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke-cpu", action="store_true", help="gloo, small model, eager stages")


def _mesh_of(s: str) -> tuple:
    dims = tuple(int(x) for x in s.lower().split("x"))
    if len(dims) != 3:
        raise SystemExit(f"a mesh is dp x pp x tp, e.g. 2x2x2; got {s!r}")
    return dims


def _cfg():
    cfg = fxopt.Config()
    cfg.attention.enabled = False  # plans and CPU runs: the graph the TP and pipeline passes see
    return cfg


def plan_rows(args) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model = build(args.layers, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    rows = []
    for spec in args.meshes.split(","):
        dp, pp, tp = _mesh_of(spec)
        world = dp * pp * tp
        x = torch.randint(0, 32000, (args.batch, args.seq), generator=g)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
            t0 = time.perf_counter()
            r = distribute(model, (x,), mesh=mesh, microbatches=args.microbatches if pp > 1 else 1,
                           schedule="1F1B", config=_cfg(), training=False, plan_only=True)
            plan_s = time.perf_counter() - t0
        finally:
            dist.destroy_process_group()
        p = r.plan
        print(p)
        b = p.bytes_per_step()
        stages = ([f"{s.modules[0]}..{s.modules[1]}" for s in p.pipeline_plan.stages] if p.pipeline_plan else ["all"])
        tpp = p.tp_plan
        rows.append({
            "mesh dp x pp x tp": spec, "ranks": world, "microbatches": p.microbatches,
            "tp collectives / layer": (f"{(tpp.all_reduces + tpp.all_gathers) / args.layers:.2f}" if tpp else "-"),
            "rank 0 sends tp MB": round(b["tp"] / 2**20, 2), "pp MB": round(b["pp"] / 2**20, 2),
            **_bubbles(pp, p.microbatches, training=True, layers=args.layers),
            "stage balance": round(p.pipeline_plan.balance, 3) if p.pipeline_plan else "-",
            "stages": " | ".join(stages), "plan s": round(plan_s, 1),
        })
    return rows


def _bubbles(pp: int, microbatches: int, training: bool, layers: int) -> dict:
    """Predicted bubble of each schedule (fxopt.parallel.schedules) and the one ``schedule="auto"`` picks."""
    if pp <= 1:
        return {"auto picks (training)": "-"}
    best, table = choose_schedule(pp, microbatches, training, layers)
    out = {f"training bubble {k}": (round(v, 3) if isinstance(v, float) else "-") for k, v in table.items()}
    out["auto picks (training)"] = best
    return out


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, iters) -> float:
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t0) / iters


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def one_gpu_rows(args, device) -> list:
    model = build(args.layers, device, small=args.smoke_cpu)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32000, (args.batch, args.seq), generator=g).to(device)
    y = torch.randint(0, 32000, (args.batch, args.seq), generator=g).to(device)
    fn = torch.compile(model, backend="fxopt_eager" if args.smoke_cpu else "fxopt")
    with torch.no_grad():
        t_fwd = _time(lambda: fn(x), args.iters)
    model.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def train():
        opt.zero_grad(set_to_none=True)
        _loss(fn(x), y).backward()
        opt.step()

    t_train = _time(train, max(2, args.iters // 2))
    return [{"variant": "one device", "mesh": "1x1x1", "prefill tok/s": round(x.numel() / t_fwd),
             "train step ms": round(t_train * 1e3, 1)}]


def mesh_rows(args) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    dp, pp, tp = _mesh_of(args.mesh)
    rank = dist.get_rank()
    device = torch.device("cpu") if args.smoke_cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build(args.layers, device, small=args.smoke_cpu)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32000, (args.batch, args.seq), generator=g).to(device)
    mesh = init_device_mesh(device.type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    rows = []
    r = distribute(model, (x,), mesh=mesh, microbatches=args.microbatches if pp > 1 else 1, schedule="1F1B",
                   config=_cfg(), training=False, device=device, compile=not args.smoke_cpu)
    t_fwd = _time(lambda: r.forward(x), args.iters)
    rows.append({"variant": "fxopt.distribute", "mesh": args.mesh, "prefill tok/s": round(x.numel() / t_fwd),
                 "predicted bubble": round(r.plan.bubble, 3)})
    if pp == 1 and dp == 1 and tp > 1:
        dt = dtensor_model(model, tp, device.type)
        fn = torch.compile(dt, backend="fxopt_eager" if args.smoke_cpu else "fxopt")
        with torch.no_grad():
            t_dt = _time(lambda: fn(x), args.iters)
        rows.append({"variant": "DTensor parallelize_module", "mesh": args.mesh,
                     "prefill tok/s": round(x.numel() / t_dt), "predicted bubble": 0.0})
    if rank == 0:
        print(r.plan)
    return rows


def main():
    args = parse_args("fxopt.distribute: plans, one device, meshes", _args, smoke=lambda a: a.smoke_cpu)
    if args.plan:
        rows = plan_rows(args)
        write_results("distributed", rows, part="plan", title=f"fxopt.distribute plans, Llama-3-8B-shaped, "
                      f"{args.layers} layers, batch {args.batch} x {args.seq} tokens (fake process group, rank 0)",
                      out_dir=args.out)
        return
    if args.one_gpu:
        device = torch.device("cpu") if args.smoke_cpu else torch.device("cuda")
        rows = one_gpu_rows(args, device)
        write_results("distributed", rows, part="one_gpu", title=f"one device, Llama-3-8B-shaped, {args.layers} "
                      "layers", out_dir=args.out)
        return
    if args.mesh is None:
        raise SystemExit("give --plan, --one-gpu or --mesh dp x pp x tp (under torchrun)")
    dist.init_process_group("gloo" if args.smoke_cpu else "nccl")
    try:
        rows = mesh_rows(args)
        if dist.get_rank() == 0:
            write_results("distributed", rows, part=f"mesh {args.mesh}", title=f"fxopt.distribute {args.mesh}, "
                          f"{args.layers} layers", out_dir=args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
