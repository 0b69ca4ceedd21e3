"""Shampoo's declaration: its run-file section, its task rules and where its torch parts live. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
import typing
from typing import Any, Literal

from pipefisher.core.settings import STEP_CEILING, ConfigError, setting
from pipefisher.methods.method import CurvatureMethod, TaskRules, WorkLabels
from pipefisher.methods.settings import RefreshConfig, StatisticsDtype

#: how the inverse 4th root is computed: float64 eigendecomposition or the coupled Newton iteration
RootMethod = Literal["eigen", "newton"]
ROOT_METHODS: tuple[RootMethod, ...] = typing.get_args(RootMethod)
#: the optimizer whose direction gives each block's step size
Grafting = Literal["adam", "sgd", "none"]
GRAFTINGS: tuple[Grafting, ...] = typing.get_args(Grafting)


@dataclass(frozen=True)
class ShampooConfig(RefreshConfig):
    """Shampoo settings (used with optimizer.name shampoo; `pipefisher.methods.shampoo`): the
    statistics come from the gradient of every refresh cycle's first step. Placement keys as
    `RefreshConfig`."""

    # the one settings class of Shampoo: the run file's section, and what `ShampooEngine` takes
    # (with the values of the rest of the run on their own: Adam grafting's decay and epsilon, dtype)

    beta2: float = setting(1.0, "decay of the statistics", low=0, high=1, low_open=True, note="1 = a plain sum")
    epsilon: float = setting(1e-12, "added before the inverse 4th root", low=0, low_open=True)
    block_size: int = setting(1024, "longer dimensions are cut into blocks of this size", low=0, low_open=True)
    root: RootMethod = setting("eigen", "how the inverse 4th root is computed")
    grafting: Grafting = setting(
        "adam", "the step size comes from this optimizer's (adam: optimizer.betas[1], optimizer.eps)"
    )
    start_step: int = setting(0, "steps before it use the grafting direction alone", low=0, ceiling=STEP_CEILING)
    statistics_dtype: StatisticsDtype = setting(
        "float64",
        "dtype of the statistics (GGᵀ squares the gradient's condition number; float32 resolves ~1e-7 of its largest eigenvalue)",
    )

    def check(self, name: str, config: Any) -> None:
        if config.optimizer.name == name and self.helpers and self.grafting == "none":
            raise ConfigError(
                f"{name}.helpers: its P op takes the products before clipping, which only grafting's norm "
                f"transfer undoes; set {name}.grafting adam or sgd, or {name}.helpers false"
            )

    def precondition_op(self, replicas: int, zero: int) -> bool:
        """A P op (the products before the step end, `pipefisher.methods.shampoo.helping`) only with
        `helpers`, on a stage held once and unsharded; else all of it in the optimizer step."""
        return self.helpers and replicas == 1 and zero < 2

    @property
    def matrices_only(self) -> bool:
        """Whether the engine holds only the matrices: the other parameters take the run's
        first-order rule, unless they step with Shampoo's SGD (first_order sgd) and so take the
        grafting direction."""
        return self.first_order != "sgd"


#: Shampoo's statistics need the stage's whole gradient: one sync (part 0's) carries it to both
#: parts, the left (L) and right (R) statistics whose inverse 4th roots are its refresh work; with
#: `helpers` a P op takes each step's products, some of them on other ranks (help ops)
SHAMPOO = CurvatureMethod(
    name="shampoo",
    label="Shampoo",
    rules=TaskRules(
        curvature=False,
        syncs=(0,),
        sync_of=((0, 0), (1, 0)),
        precondition=True,
        labels=WorkLabels(parts=("left", "right"), refresh="root"),
        helpers=True,
        step_end_precondition=True,
    ),
    settings=ShampooConfig,
    parts="pipefisher.methods.shampoo.parts:PARTS",
    flops="pipefisher.methods.shampoo.flops:task_flops",
    memory="pipefisher.methods.shampoo.memory:ShampooLayer",
    shards=True,
)
