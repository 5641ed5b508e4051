"""Attention pass: SDPA and hand-written attention → ``torch.ops.fxopt.flash_attention``.

A region is rewritten only when every node in it is accounted for and every value proven; anything else stays as it
was, with a reason. What is matched, the exactness rules and the derivations behind them: docs/architecture.md,
"The attention pass". Modules: :mod:`.graph` (op names, casts, scalars, in-place writes, constant evaluation, the node
builder), :mod:`.masks` (masks, proofs, fully masked rows), :mod:`.matcher` (softmax / P @ V / score chain / SDPA),
:mod:`.rewrite` (checks, the fused node, the pass).
"""
from .rewrite import attention_pass

__all__ = ["attention_pass"]
