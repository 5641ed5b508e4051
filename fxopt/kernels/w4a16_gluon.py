"""Import path of ``sass_of`` / ``wgmma_sass_hazards`` for the attention family's offline checks: both live in
``tools/sass.py`` (outside the package, read from a checkout). The W4A16 Gluon kernel is
:mod:`fxopt.kernels.w4a16.gluon`."""


def __getattr__(name):
    if name in ("sass_of", "wgmma_sass_hazards"):
        from tools import sass

        return getattr(sass, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
