"""The torch.compile entry points: ``backend="fxopt"`` (passes, then Inductor) and ``"fxopt_eager"`` (passes, then
the rewritten graph as is, for debugging a pass). Both are installed as ``torch_dynamo_backends`` entry points."""
from .fxopt_backend import Backend, fxopt_backend, fxopt_eager_backend, register_backends

__all__ = ["Backend", "fxopt_backend", "fxopt_eager_backend", "register_backends"]
