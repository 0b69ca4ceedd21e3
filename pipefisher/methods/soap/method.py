"""SOAP's declaration: its run-file section, its task rules and where its torch parts live. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipefisher.core.settings import setting
from pipefisher.methods.method import CurvatureMethod, TaskRules, WorkLabels
from pipefisher.methods.settings import RefreshConfig, StatisticsDtype


@dataclass(frozen=True)
class SoapConfig(RefreshConfig):
    """SOAP settings (used with optimizer.name soap; `pipefisher.methods.soap`): Adam in the
    eigenbases of Shampoo's statistics, which come from the reduced gradient of every step; the
    refresh of the eigenbases goes into the bubbles. The published hyper-parameters are the
    defaults; weight decay is optimizer.weight_decay (published: 0.01); the published refresh
    interval (precondition frequency) is 10 where one is fixed (refresh_steps; 0 lets the packer
    choose). Placement keys as `RefreshConfig`."""

    # the one settings class of SOAP: the run file's section, and what `SoapEngine` takes (with its
    # own working dtype)

    lr: float = setting(3e-3, "learning rate of SOAP's step (0 = optimizer.lr)", low=0)
    beta1: float = setting(0.95, "decay of Adam's first moment", low=0, high=1, high_open=True)
    beta2: float = setting(0.95, "decay of Adam's second moment (in the eigenbasis)", low=0, high=1, high_open=True)
    statistics_beta: float = setting(
        0.0, "decay of the statistics L, R", low=0, high=1, high_open=True, note="0 = beta2"
    )
    epsilon: float = setting(1e-8, "added to the square root of the second moment", low=0, low_open=True)
    block_size: int = setting(1024, "longer dimensions are cut into blocks of this size", low=0, low_open=True)
    statistics_dtype: StatisticsDtype = setting(
        "float64", "dtype of the statistics (float64 resolves their null space, which decides the eigenbasis there)"
    )
    fold: Literal["step-end", "bubbles"] = setting(
        "step-end",
        "where each step's gradient is folded into the statistics: step-end (with the directions) or bubbles (its "
        "U op in the next step's bubbles, holding a copy of the gradient until then; the same results)",
    )

    def precondition_op(self, replicas: int, zero: int) -> bool:
        """A P op (the gradient rotated into its eigenbases before the step end,
        `pipefisher.methods.soap.helping`) only with `helpers`, on a stage held once and
        unsharded; else all of the rotations in the optimizer step."""
        return self.helpers and replicas == 1 and zero < 2

    @property
    def statistics_decay(self) -> float:
        """The decay of the statistics in use: `statistics_beta`, or `beta2` when it is 0."""
        return self.statistics_beta or self.beta2

    def zero1_problem(self, name: str, replicas: int) -> str:
        return (
            f"optimizer.zero: {name} keeps every replica's statistics from the reduced gradient, "
            "which ZeRO-1 gives the owner only; use optimizer.zero 0, 2 or 3"
        )


#: SOAP's statistics come from the reduced gradient at each step's end, alike on every replica: no
#: syncs; the fold of that gradient into them is its U op, one per stage and step (with `fold:
#: bubbles` it does the fold in the next step's bubbles; with step-end nothing); its refresh work
#: per layer is the new left (part 0) and right (part 1) eigenbasis; with `helpers` a P op rotates
#: each step's gradient into the eigenbases, some matrices on other ranks (help ops)
SOAP = CurvatureMethod(
    name="soap",
    label="SOAP",
    rules=TaskRules(
        curvature=False,
        syncs=(),
        sync_of=(),
        precondition=True,
        labels=WorkLabels(parts=("left", "right"), refresh="basis", precondition="rotation in"),
        deferred_statistics=True,
        helpers=True,
        step_end_precondition=True,
    ),
    settings=SoapConfig,
    parts="pipefisher.methods.soap.parts:PARTS",
    flops="pipefisher.methods.soap.flops:task_flops",
    memory="pipefisher.methods.soap.memory:SoapLayer",
    shards=True,
)
