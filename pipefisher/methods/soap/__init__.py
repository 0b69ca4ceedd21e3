"""SOAP (Vyas et al. 2024): Adam in the eigenbasis of Shampoo's statistics, with blocking.

:class:`SOAP` is the single-process front; :class:`SoapEngine` exposes the same per-matrix
operations one call at a time for the pipeline executor. The method's declaration
(`pipefisher.methods.soap.method`) is torch-free; the names below import torch on first use.
"""

from importlib import import_module

_EXPORTS = {
    "SOAP": "front",
    "SoapStep": "front",
    "SoapEngine": "engine",
    "SoapHealth": "health",
    "SoapNumericsWarning": "health",
    "SoapConfig": "method",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
