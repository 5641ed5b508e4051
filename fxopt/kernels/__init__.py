"""Triton kernels, each reached only through its ``torch.ops.fxopt.*`` custom op.

Importing this package registers every op (``fxopt.kernels.ops``).
"""
