"""The method's declaration: its run-file section `diag_ggn`, its task rules, where its torch
side lives. Pure Python (planning imports it without torch)."""

from __future__ import annotations

from dataclasses import dataclass

from pipefisher.core.settings import setting
from pipefisher.methods.memory import MatrixLayer
from pipefisher.methods.method import CurvatureMethod, TaskRules, WorkLabels
from pipefisher.methods.settings import RefreshConfig


@dataclass(frozen=True)
class DiagGgnConfig(RefreshConfig):
    """Diagonal GGN settings (used with optimizer.name diag_ggn)."""

    decay: float = setting(0.5, "decay of the running means of a² and e²", low=0, high=1, high_open=True)
    damping: float = setting(0.1, "added to each running mean before its inverse square root", low=0, low_open=True)


@dataclass(frozen=True)
class DiagGgnLayer(MatrixLayer):
    """Its memory model of a Linear layer's weight (`rows` outputs x `cols` inputs)."""

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """Sums, running means and scales in use of a² and e², float64, on every replica."""
        return 3 * 8 * (self.rows + self.cols)


DIAG_GGN = CurvatureMethod(
    name="diag_ggn",
    label="Diagonal GGN",
    # per layer two parts (0: inputs, 1: output gradients), each built per micro-batch (C), summed
    # over replicas (S), refreshed (R), and a P op per stage and step before the gradient reduction
    rules=TaskRules(
        curvature=True,
        syncs=(0, 1),
        sync_of=((0, 0), (1, 1)),
        precondition=True,
        labels=WorkLabels(parts=("input", "output-gradient"), refresh="scale"),
    ),
    settings=DiagGgnConfig,
    parts="pipefisher_diagonal_ggn.runtime:PARTS",
    flags=("damping",),
    memory="pipefisher_diagonal_ggn.method:DiagGgnLayer",
)
