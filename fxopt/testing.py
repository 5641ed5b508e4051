"""Helpers for fxopt's own tests: :func:`run_on_ranks` (spawned ranks of a gloo or NCCL process group)."""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, errors, backend):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:  # report every failure, not only Exceptions
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world_size: int = 2, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (spawned) of a ``backend`` process group."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"backend='nccl' with {world_size} ranks needs {world_size} GPUs, "
                           f"found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if not errors.empty():
        rank, tb = errors.get()
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"ranks exited with codes {bad}")
