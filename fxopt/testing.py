"""Helpers for fxopt's own tests (and users' tests of distributed passes).

``run_on_ranks(fn, world_size=2, *args)`` spawns ``world_size`` processes, each of
which initializes a gloo process group on a free localhost port, calls
``fn(rank, world_size, *args)`` and tears the group down. A failure on any rank is
re-raised in the caller with that rank's traceback.
"""
from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, errors):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:  # report every failure, not only Exceptions
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world_size: int = 2, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (spawned)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors))
        for r in range(world_size)
    ]
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
