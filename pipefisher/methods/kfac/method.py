"""K-FAC's declaration: its run-file section, its task rules and where its torch parts live. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
import typing
from typing import Any, Literal

from pipefisher.core.settings import ConfigError, setting
from pipefisher.methods.method import CurvatureMethod, TaskRules, WorkLabels
from pipefisher.methods.settings import RefreshConfig
from pipefisher.planning.replicas.kaisa import worker_count

#: how a damped factor is inverted
InverseMethod = Literal["eigen", "cholesky"]
INVERSE_METHODS: tuple[InverseMethod, ...] = typing.get_args(InverseMethod)
#: how a layer applied to every position of a sequence (weight sharing) becomes factor rows
Approximation = Literal["expand", "reduce"]


@dataclass(frozen=True)
class KfacConfig(RefreshConfig):
    """K-FAC settings (used with optimizer.name kfac)."""

    # the one settings class of K-FAC: the run file's section, and what `KFACEngine` takes (with
    # the engine's own grad_scale, kl_clip and max_factor_dim); its docstring is the page's text

    damping: float = setting(1e-3, "added to each factor before its inverse", low=0, low_open=True)
    factor_decay: float = setting(0.95, "EMA decay of the factors", low=0, high=1, high_open=True)
    inverse: InverseMethod = setting(
        "cholesky",
        "how a damped factor is inverted: cholesky (no host sync; on rounding-indefinite factors it fails and the layer keeps its previous inverse) or eigen (clamps negative eigenvalues; syncs with the host on CUDA)",
    )
    approximation: Approximation = setting(
        "expand",
        "rows of a factor for a layer applied at every position of a sequence (Eschenhagen et al. 2023): expand (one row "
        "per token) or reduce (one per sequence: inputs averaged, output gradients summed over its positions; curvature "
        "costs 1/sequence-length as much)",
    )
    grad_worker_fraction: float = setting(
        1.0,
        "share of a stage's R replicas that keep each layer's inverses, precondition its reduced gradient and broadcast it "
        "(KAISA; a multiple of 1/R that divides R; 1 = every replica preconditions before the reduction)",
    )

    def check(self, name: str, config: Any) -> None:
        if config.optimizer.name != name:
            return
        if config.run.compile:
            raise ConfigError(
                f"run.compile: {name} captures each layer's inputs and output gradients with hooks registered per "
                "micro-batch, which split every compiled block and recompile it each micro-batch; set run.compile false"
            )

    def gradient_workers(self, replicas: int, sharded: bool = False) -> int:
        return worker_count(replicas, self.grad_worker_fraction)

    def captures_per_sequence(self) -> bool:
        return self.approximation == "reduce"


KFAC = CurvatureMethod(
    name="kfac",
    label="K-FAC",
    rules=TaskRules(
        curvature=True,
        syncs=(0, 1),
        sync_of=((0, 0), (1, 1)),
        precondition=True,
        labels=WorkLabels(parts=("A factor", "B factor"), refresh="inverse"),
        shared_when_split=(("column", 0), ("row", 1)),
        helpers=True,
    ),
    settings=KfacConfig,
    parts="pipefisher.methods.kfac.parts:PARTS",
    flops="pipefisher.methods.kfac.flops:task_flops",
    flags=("approximation", "grad_worker_fraction"),
    memory="pipefisher.methods.kfac.memory:KfacLayer",
    shards=True,  # under ZeRO-2/3 P preconditions the reduced gradients whole (`pipefisher.methods.kfac.step`)
)
