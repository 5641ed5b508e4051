"""Attention pass: SDPA and hand-written attention → ``torch.ops.fxopt.flash_attention``.

Matched on Dynamo's torch-level graph (ops named through :mod:`fxopt.passes.match`; ATen spellings written in the
model read as the torch-level op):

* ``F.scaled_dot_product_attention`` (every argument). Its ``is_causal`` is top-left aligned, the kernel's
  bottom-right: they agree when Sq == Sk; otherwise an explicit ``ones(Sq, Sk).tril()`` mask is built.
* Hand-written attention, anchored at each softmax over the last dim::

      QK  = matmul(q, kᵀ) | bmm | einsum          (q, kᵀ may carry a scalar mul/div: number, sqrt(d), math.sqrt)
      s   = QK [* c | / c]... [softcap: tanh(s / c) * c] [+ mask | masked_fill(m, fill) | where(m, s, fill)]...
      p   = softmax(s [.float()], -1 [, dtype]) [.to(dtype)] [dropout(p, training)]
      out = matmul(p, v) | bmm | einsum

  A scale may be a number, a SymInt / SymFloat or a 0-d tensor (it then moves onto q). 3-D bmm graphs run as one
  batch of B*H heads; einsum operands are permuted into [B, H, S, D]; views that only split or merge the batch dims
  may sit on the scores and probabilities. repeat_kv on *both* k and v is dropped: the kernel does GQA natively.

Masks become keep literals (bool, True = attend) with fill values, plus additive masks; transformers' additive
``where(keep, 0, fill)`` is a keep literal. With ``cfg.lower_masks`` the literals are proven causal (bottom-right),
sliding window or key padding ``P[:, :Sk].bool()`` by evaluating their subgraph on CPU at the captured sizes (an
index probe for gathers from one input); then the kernel gets ``is_causal`` / ``window`` / ``key_padding_mask`` and
no S×S tensor.

Exactness: a region is rewritten only when every node in it is accounted for and every value proven.

* A fill masks only when it is -inf or <= finfo(dtype).min of the scores it is written into.
* Casts on the scores / probabilities go to float32, float64 or q's dtype only.
* No in-place write to what the op reads, nor to an intermediate, inside the region; the prover never evaluates a
  subgraph touched by a write. ``s += mask`` on a fresh, otherwise unused intermediate is its functional form.
* Rows where every key may be masked get eager's value (NaN, or the mean of v), gradients included, or the region
  stays with the reason.
* Empty dims stay out of the kernels; the output gets the original's strides; a node is created only after its fake
  value was computed; the pass never re-runs fake propagation (symbolic sizes stay symbolic).

Activation-checkpoint bodies (``tag_activation_checkpoint``) are rewritten as well, except with dropout.
The derivations behind each rule: docs/architecture.md, "The attention pass".

Modules: :mod:`.graph` (op names, casts, scalars, in-place writes, constant evaluation, the node builder),
:mod:`.masks` (mask description, proofs, fills, fully masked rows), :mod:`.matcher` (softmax / P @ V / score chain /
SDPA matching), :mod:`.rewrite` (checks, the fused node, the pass and its registration).
"""
from .rewrite import attention_pass

__all__ = ["attention_pass"]
