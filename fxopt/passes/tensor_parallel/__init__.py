"""The ``tensor_parallel`` pass: Megatron's layout, found from the graph's dataflow (not from module names).

It runs on the graph :func:`fxopt.parallelize` captures (``ctx.extras["tensor_parallel"]`` is a :class:`TPContext`);
elsewhere it leaves the graph alone, with a reason. Column-parallel seeds at every linear with a parameter weight,
one propagation sweep to a fixed point, then the rewrite and a check of every node's local shape. Design:
docs/architecture.md, "Tensor parallel". Modules, imports pointing one way: plan, collectives, ops, linears, rules,
search, sequence_parallel, rewrite, entry.
"""
from .collectives import tp_copy
from .entry import tensor_parallel_pass
from .plan import Shard, ShardedInputError, TensorParallelPlan, TensorShard, TPContext

__all__ = ["Shard", "ShardedInputError", "TPContext", "TensorParallelPlan", "TensorShard", "tensor_parallel_pass",
           "tp_copy"]
