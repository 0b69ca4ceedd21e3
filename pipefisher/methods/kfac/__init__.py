"""K-FAC engine: per-layer curvature, sync, damped inverses and preconditioning.

:class:`KFAC` is the single-process front; :class:`KFACEngine` exposes the same per-layer
operations one call at a time for the pipeline executor.
"""

from pipefisher.methods.kfac.engine import KFACConfig, KFACEngine, KFACNumericsWarning, PreconditionReport
from pipefisher.methods.kfac.factors import InverseMethod
from pipefisher.methods.kfac.front import KFAC
from pipefisher.methods.kfac.layer import FACTORS, Factor, Health, LayerInfo

__all__ = [
    "FACTORS",
    "KFAC",
    "Factor",
    "Health",
    "InverseMethod",
    "KFACConfig",
    "KFACEngine",
    "KFACNumericsWarning",
    "LayerInfo",
    "PreconditionReport",
]
