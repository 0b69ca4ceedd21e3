"""Muon's declaration: its run-file section, its task rules and where its torch parts live. Pure Python.

Muon has no refresh work: its work is the orthogonalisation of every step, the P op of a stage.
On a stage with one replica the P op runs as soon as the stage's gradient is final (in the drain
bubble on most stages); a replicated stage (Chimera's pipes, data-parallel copies) orthogonalises
after its gradient reduction, each replica a share of the matrices (one gradient worker per
matrix, `gradient_workers`), and broadcasts its share. Under optimizer.zero 2/3 (FSDP2) each
replica gathers every reduced gradient whole after the stage's last backward and orthogonalises
all of them (`pipefisher.methods.muon.runtime`); ZeRO-1 is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
import typing
from typing import Any, Literal

from pipefisher.core.settings import STEP_CEILING, ConfigError, setting
from pipefisher.methods.method import CurvatureMethod, TaskRules, WorkLabels
from pipefisher.methods.settings import RefreshConfig

#: the quintic Newton–Schulz coefficients (a, b, c) of Keller Jordan's Muon
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: the shape scale of the step of a (rows, cols) matrix (`pipefisher.methods.muon.newton_schulz.shape_scale`)
AdjustLr = Literal["original", "match_rms_adamw"]
ADJUST_LR: tuple[AdjustLr, ...] = typing.get_args(AdjustLr)
#: the dtypes of the Newton–Schulz iteration (the name of a torch dtype)
NsDtype = Literal["float32", "bfloat16", "float64"]


@dataclass(frozen=True)
class MuonConfig(RefreshConfig):
    """Muon settings (used with optimizer.name muon; `pipefisher.methods.muon`): momentum
    orthogonalised by Newton–Schulz every step for the weights of linear layers but the model's
    first-order ones and tied copies; the other parameters take the first-order rule. Of the
    placement keys, refresh_steps only sets how many steps a plan's cycle has, max_overhead,
    max_refresh_steps and max_capture_mb have nothing to act on, and split cannot be turned off."""

    # the one settings class of Muon: the run file's section, and what `MuonEngine` and the maths
    # of `newton_schulz` take as it is

    refresh_steps: int = setting(
        10,
        "steps per plan cycle: Muon's work is the same every step, so this is only how often the run "
        "compares measured and predicted time (re-profiling)",
        low=0,
        note="0 lets the packer choose: 1",
        ceiling=STEP_CEILING,
    )
    momentum: float = setting(0.95, "Muon's momentum μ: B ← μB + (1 − μ)g", low=0, high=1, high_open=True)
    nesterov: bool = setting(True, "orthogonalise g + μ(B − g) (Nesterov) instead of B")
    ns_steps: int = setting(5, "Newton–Schulz iterations", low=1, high=99)
    ns_coefficients: tuple[float, float, float] = setting(NS_COEFFICIENTS, "quintic Newton–Schulz coefficients a, b, c")
    eps: float = setting(1e-7, "floor of the Frobenius norm the momentum is divided by first", low=0, low_open=True)
    adjust_lr: AdjustLr = setting(
        "original",
        "shape scale of the step of a (rows, cols) matrix: original √max(1, rows/cols); "
        "match_rms_adamw 0.2·√max(rows, cols)",
    )
    ns_dtype: NsDtype = setting(
        "float32",
        "dtype of the Newton–Schulz iteration (bfloat16 as torch.optim.Muon, fast on GPUs, but its rounding "
        "can turn a gradient summed in another order, over replicas, into an update 2 % apart)",
    )

    def check(self, name: str, config: Any) -> None:
        if config.optimizer.name != name:
            return
        if not self.split:
            raise ConfigError(
                f"{name}.split: false is not possible: a replicated stage always orthogonalises a share "
                "per replica after the gradient reduction; remove the key"
            )

    def zero1_problem(self, name: str, replicas: int) -> str:
        if replicas < 2:
            return ""
        return (
            f"optimizer.zero: {name} shares each replicated stage's orthogonalisation among its replicas "
            "itself, which needs every replica's reduced gradient; use optimizer.zero 0, 2 or 3"
        )

    def gradient_workers(self, replicas: int, sharded: bool = False) -> int:
        """One replica orthogonalises each matrix (after the reduction) and broadcasts it; with
        `sharded` gradients every replica gathers and orthogonalises every matrix."""
        return replicas if sharded else 1


MUON = CurvatureMethod(
    name="muon",
    label="Muon",
    rules=TaskRules(
        curvature=False,
        syncs=(),
        sync_of=(),
        precondition=True,
        labels=WorkLabels(parts=(), precondition="orthogonalisation"),
        helpers=True,
    ),
    settings=MuonConfig,
    parts="pipefisher.methods.muon.parts:PARTS",
    flops="pipefisher.methods.muon.flops:task_flops",
    flags=("momentum", "adjust_lr"),
    memory="pipefisher.methods.muon.memory:MuonLayer",
    shards=True,
)
