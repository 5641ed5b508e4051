"""The ``tensor_parallel`` pass: Megatron's layout, found from the graph's dataflow (not from module names).

Design
------
The pass runs on the torch-level Dynamo graph that :func:`fxopt.parallelize` captures (parameters are placeholders;
``ctx.extras["tensor_parallel"]`` is a :class:`TPContext` naming the process group, the rank, and which placeholders
are parameters/buffers). Outside ``parallelize`` it leaves the graph alone (with a reason).

**State.** Every tensor node is either replicated (``None``: each rank holds the full value) or a :class:`Shard`:
sharded along ``dim`` with a *section layout* ``((size, rf), ...)``: the global dim is cut into sections (one for a
plain projection, three for a fused ``c_attn`` qkv, two for a fused gate/up) and each rank holds, of every section,
the chunk ``rank // rf`` of ``tp // rf`` equal chunks (``rf`` > 1 = a replication factor, used for GQA kv heads when
``tp`` exceeds their number: each rank keeps the one kv head its query heads read). The local tensor is the
concatenation of its chunks.

**Search (greatest fixed point).** Every linear with a parameter weight (``F.linear``, GPT-2 ``Conv1D``'s
``addmm``, ``fxopt::w4a16_linear``, ``linear(x, dequantize_w4(...))``) starts as a column-parallel *seed*. One
topological sweep propagates states; a linear whose input is sharded along its feature dim becomes row-parallel
(output replicated after one all-reduce). Ops that work per shard carry the state (elementwise ops with
broadcasting, view/reshape/flatten with dim-group tracking, expand, transpose/permute, unsqueeze, getitem,
split/chunk/unbind, cat/stack (cat skips legacy empty ``(0,)`` operands, as torch.cat does), softmax and reductions
off the sharded dim, batched matmul over a sharded batch dim, ``F.scaled_dot_product_attention`` and
``fxopt::flash_attention`` over heads with GQA checked rank by rank). Any other use of a sharded tensor (a norm over
the sharded dim, a residual add with a replicated tensor, the graph output, an in-place op, ...) is a *conflict*:
the seeds that reach it are dropped, with the reason, and the sweep repeats until none is left. Graph outputs that
``TPContext.shardable_outputs`` names (the tensors of the model's KV-cache object) may stay sharded;
``TPContext.sharded_inputs`` (a cache passed back) start sharded, and a conflict one reaches raises
:class:`ShardedInputError` (no seed can undo it). So everything unproven stays replicated; what remains is
Megatron's plan: q/k/v (column) → rotary/attention → o_proj (row) + all-reduce; gate/up (column) → act·mul → down
(row) + all-reduce.

**Rewrite.** Sharded weights/biases become local (their placeholders get local fake values; the plan records how
to cut every real tensor: :class:`TensorShard`). Literal sizes in view/reshape/expand/split args at the sharded
position become local sizes (``-1`` stays; a symbolic size there is a conflict). A row-parallel linear loses its
bias, gets ``_c10d_functional.all_reduce`` + ``wait_tensor`` and the bias is added after. In training form
(``TPContext.training``) the all-reduce's backward is made the identity (``y = ar(x.detach()) + (x - x.detach())``)
and Megatron's *f* (``fxopt::tp_copy``: identity forward, all-reduce backward) guards every replicated tensor that
needs grad where it enters a sharded computation. With ``vocab_parallel`` a sharded tensor reaching the graph output
(the lm_head logits) is all-gathered, and an embedding tied to that lm_head is cut by the same vocabulary rows
(masked lookup + all-reduce); an untied embedding is cut only with ``vocab_parallel_embedding`` (its all-reduce costs
more time than the replicated lookup, which only costs memory).
Afterwards the whole graph is fake-propagated again and every node's shape is checked against the plan's
prediction: a mismatch raises (a wrong shard is never produced silently).

Modules, imports pointing one way in this order: :mod:`.plan` (``Shard``, ``TensorShard``, ``TensorParallelPlan``,
``TPContext``, errors), :mod:`.collectives` (``fxopt::tp_copy``, the functional c10d ops), :mod:`.ops` (op tables,
shapes, size arguments), :mod:`.linears` (linear sites), :mod:`.rules` (the sweep and its ``rule_*``),
:mod:`.search` (seeds, GQA replication, fixed point), :mod:`.sequence_parallel`, :mod:`.rewrite` (cuts, collectives,
overlap chunks, vocab parallel, *f*), :mod:`.entry` (the pass, its registration, the local-shape check).
"""
from .collectives import tp_copy
from .entry import tensor_parallel_pass
from .plan import Shard, ShardedInputError, TensorParallelPlan, TensorShard, TPContext
from .plan import _Conflict  # noqa: F401  (the rule tests raise and catch it)
from .rules import _reshape_map  # noqa: F401  (the rule tests call it)

__all__ = ["Shard", "ShardedInputError", "TPContext", "TensorParallelPlan", "TensorShard", "tensor_parallel_pass",
           "tp_copy"]
