"""Linear sites: every linear whose weight is a parameter (``F.linear``, GPT-2 ``Conv1D``'s ``addmm``,
``fxopt::w4a16_linear``, ``linear(x, dequantize_w4(...))``), with its input, weight, bias and feature sizes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.fx as fx

from .. import match
from .ops import _kind, _shape
from .plan import TPContext


@dataclass
class _Linear:
    node: fx.Node
    x: fx.Node
    kind: str  # "dense" (W [N, K]), "conv1d" (addmm, W [K, N]), "w4a16" (fused), "dequant" (linear of dequantize_w4)
    weight: fx.Node  # dense weight placeholder, or qweight placeholder
    bias: Optional[fx.Node]
    N: int
    K: int
    qparams: tuple = ()  # (qweight, scales, zeros) placeholders
    group_size: int = 0
    dequant: Optional[fx.Node] = None
    casts: tuple = ()  # cast nodes between state placeholders and their use (dequant path)


def _strip_casts(n):
    chain = []
    while isinstance(n, fx.Node) and n.op == "call_method" and n.target in ("to", "float", "half", "bfloat16") \
            and len(n.users) == 1:
        chain.append(n)
        n = n.args[0]
    return n, chain


def _int4(node, x, kind: str, qparams: tuple, bias, group_size: int, **extra) -> _Linear:
    """An int4 linear: qweight [K / 8, N]; group size -1 means one group over all of K."""
    K, N = _shape(qparams[0])[0] * 8, _shape(qparams[0])[1]
    return _Linear(node, x, kind, qparams[0], bias, N, K, qparams, K if group_size == -1 else group_size, **extra)


class _Finder:
    def __init__(self, gm: fx.GraphModule, tpc: TPContext):
        self.gm, self.tpc = gm, tpc

    def is_state(self, n) -> bool:
        return isinstance(n, fx.Node) and n.op == "placeholder" and n.name in self.tpc.params

    def linear(self, node: fx.Node) -> Optional[_Linear]:
        k = _kind(node)
        if k == "linear":
            x = match.get_arg(node, 0, "input")
            w = match.get_arg(node, 1, "weight")
            b = match.get_arg(node, 2, "bias")
            if b is not None and not self.is_state(b):
                return None
            ws, casts = _strip_casts(w)
            if self.is_state(ws):
                sh = _shape(ws)
                if sh is None or len(sh) != 2:
                    return None
                if casts:
                    return None
                return _Linear(node, x, "dense", ws, b, sh[0], sh[1])
            if isinstance(ws, fx.Node) and _kind(ws) == "dequantize_w4" and len(ws.users) == 1:
                qw, sc, zr = ws.args[0], ws.args[1], ws.args[2]
                G = ws.args[3] if len(ws.args) > 3 else ws.kwargs.get("group_size")
                srcs, all_casts = [], list(casts)
                for t in (qw, sc, zr):
                    s, c = _strip_casts(t)
                    srcs.append(s)
                    all_casts += c
                if not all(self.is_state(s) for s in srcs) or not isinstance(G, int):
                    return None
                return _int4(node, x, "dequant", tuple(srcs), b, G, dequant=ws, casts=tuple(all_casts))
            return None
        if k == "w4a16_linear":
            x, qw, sc, zr = node.args[:4]
            G = node.args[4] if len(node.args) > 4 else node.kwargs.get("group_size")
            b = node.args[5] if len(node.args) > 5 else node.kwargs.get("bias")
            if not all(self.is_state(t) for t in (qw, sc, zr)) or (b is not None and not self.is_state(b)):
                return None
            return _int4(node, x, "w4a16", (qw, sc, zr), b, G)
        if k == "addmm":
            b, x, w = node.args[:3]
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) > 3:
                return None
            if not self.is_state(w) or not self.is_state(b):
                return None
            sh = _shape(w)
            if sh is None or len(sh) != 2 or _shape(b) != (sh[1],):
                return None
            return _Linear(node, x, "conv1d", w, b, sh[1], sh[0])
        return None
