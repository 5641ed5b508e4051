"""Triton kernels, each reached only through its ``torch.ops.fxopt.*`` custom op.

Each kernel module registers its own ops when imported; ``fxopt.kernels.ops`` imports them all (passes import that).
"""
