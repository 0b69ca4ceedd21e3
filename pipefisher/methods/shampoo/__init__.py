"""Shampoo preconditioner (Gupta et al. 2018) with blocking and grafting.

:class:`Shampoo` is the single-process front; :class:`ShampooEngine` exposes the same per-matrix
operations one call at a time for the pipeline executor. The method's declaration
(`pipefisher.methods.shampoo.method`) is torch-free; the names below import torch on first use.
"""

from importlib import import_module

_BLOCKS = "pipefisher.methods.blocks"
_EXPORTS = {
    "FACTORS": _BLOCKS,
    "Factor": _BLOCKS,
    "MatrixInfo": _BLOCKS,
    "ShampooEngine": "engine",
    "Shampoo": "front",
    "ShampooHealth": "health",
    "ShampooNumericsWarning": "health",
    "Grafting": "method",
    "RootMethod": "method",
    "ShampooConfig": "method",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _EXPORTS[name]
    return getattr(import_module(module if "." in module else f"{__name__}.{module}"), name)
