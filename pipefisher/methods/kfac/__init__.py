"""K-FAC: per-layer curvature, sync, damped inverses and preconditioning.

:class:`KFAC` is the single-process front; :class:`KFACEngine` exposes the same per-layer
operations one call at a time for the pipeline executor. The method's declaration
(`pipefisher.methods.kfac.method`) is torch-free; the names below import torch on first use.
"""

from importlib import import_module

_EXPORTS = {
    "KfacConfig": "method",
    "KFACEngine": "engine",
    "KFACNumericsWarning": "settings",
    "PreconditionReport": "settings",
    "InverseMethod": "method",
    "KFAC": "front",
    "FACTORS": "layer",
    "Factor": "layer",
    "Health": "layer",
    "LayerInfo": "layer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
