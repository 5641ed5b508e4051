"""Tensor-parallel inference with ``fxopt.parallelize``: the plan is found in the model's graph.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 examples/tp_inference.py      # 2 GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/tp_inference.py                         # no GPU: gloo on CPU

Every rank builds the same model, calls ``fxopt.parallelize`` (which keeps only this rank's shards), compiles the
result with ``backend="fxopt"`` and runs it; rank 0 prints the plan, checks the logits against the full model and
greedily extends a prompt (no KV cache: each step re-runs the sequence, and each new length is re-captured once).
"""
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fxopt  # noqa: E402
from fxopt.models import TinyLlamaConfig, build_demo_model  # noqa: E402
from fxopt.parallel.tensor_parallel import parallelize  # noqa: E402


def main():
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_demo_model(0, TinyLlamaConfig()).to(device, dtype).requires_grad_(False)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)

    tp_model = parallelize(model, (prompt,), tp=world)
    if rank == 0:
        print(tp_model.plan)
        n_full = sum(p.numel() for p in model.parameters())
        n_local = sum(p.numel() for p in tp_model.parameters())
        print(f"parameters on rank 0: {n_local} of {n_full} ({n_local / n_full:.0%})")
    compiled = torch.compile(tp_model, backend="fxopt" if cuda else "fxopt_eager")
    with torch.no_grad():
        logits = compiled(prompt)
        ref = model(prompt)
        if rank == 0:
            print(f"max |TP - full| logits: {(logits.float() - ref.float()).abs().max().item():.3g}")
        seq = prompt
        for _ in range(8):
            nxt = tp_model(seq)[:, -1].argmax(-1, keepdim=True)  # eager: every length is a new graph
            seq = torch.cat([seq, nxt], dim=1)
    if rank == 0:
        print("generated:", seq[0, prompt.shape[1]:].tolist())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
