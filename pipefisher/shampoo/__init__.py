"""Shampoo preconditioner (Gupta et al. 2018) with blocking and grafting.

:class:`Shampoo` is the single-process front; :class:`ShampooEngine` exposes the same per-matrix
operations one call at a time for the pipeline executor.
"""

from pipefisher.shampoo.blocks import FACTORS, Factor, MatrixInfo
from pipefisher.shampoo.engine import ShampooEngine
from pipefisher.shampoo.front import Shampoo
from pipefisher.shampoo.health import ShampooHealth, ShampooNumericsWarning
from pipefisher.shampoo.settings import Grafting, RootMethod, ShampooSettings

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
