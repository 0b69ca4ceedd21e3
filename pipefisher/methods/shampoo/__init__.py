"""Shampoo preconditioner (Gupta et al. 2018) with blocking and grafting.

:class:`Shampoo` is the single-process front; :class:`ShampooEngine` exposes the same per-matrix
operations one call at a time for the pipeline executor.
"""

from pipefisher.methods.shampoo.blocks import FACTORS, Factor, MatrixInfo
from pipefisher.methods.shampoo.engine import ShampooEngine
from pipefisher.methods.shampoo.front import Shampoo
from pipefisher.methods.shampoo.health import ShampooHealth, ShampooNumericsWarning
from pipefisher.methods.shampoo.settings import Grafting, RootMethod, ShampooSettings

__all__ = [
    "FACTORS",
    "Factor",
    "Grafting",
    "MatrixInfo",
    "RootMethod",
    "Shampoo",
    "ShampooEngine",
    "ShampooHealth",
    "ShampooNumericsWarning",
    "ShampooSettings",
]
