"""The curvature methods the runtime knows, by `optimizer.name`: what the trainer, profiler and
reference need of each (its runtime, task timer, layers and first-order exceptions)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from pipefisher.config import RunConfig
from pipefisher.methods.interface import CurvatureRuntime, TaskTimer
from pipefisher.methods.kfac.layer import select_layers
from pipefisher.methods.kfac.ops import KfacRuntime, KfacTimer
from pipefisher.methods.rules import task_rules
from pipefisher.methods.shampoo.ops import ShampooRuntime, ShampooTimer, matrix_names, tied_skip
from pipefisher.models import StagedModel


@dataclass(frozen=True)
class CurvatureMethod:
    """`runtime(config, topology, rank, modules, comm, plan, skip, loss_scale)`; `timer(config,
    modules, skip)`; `layer_names(stage module, skip)`: the layers its tasks name, in order;
    `skip(model)`: globs of what stays first-order (K-FAC: Linear modules; Shampoo: parameters)."""

    name: str
    runtime: Callable[..., CurvatureRuntime]
    timer: Callable[[RunConfig, dict, tuple[str, ...]], TaskTimer]
    layer_names: Callable[[nn.Module, tuple[str, ...]], list[str]]
    skip: Callable[[StagedModel], tuple[str, ...]]

    @property
    def label(self) -> str:
        return task_rules(self.name).label


KFAC = CurvatureMethod(
    name="kfac", runtime=KfacRuntime,
    timer=lambda config, modules, skip: KfacTimer(modules, skip, config.kfac.damping, config.kfac.inverse),
    layer_names=lambda module, skip: list(select_layers(module, skip)),
    skip=lambda model: model.kfac_skip(),
)
SHAMPOO = CurvatureMethod(
    name="shampoo", runtime=ShampooRuntime, timer=ShampooTimer, layer_names=matrix_names,
    skip=lambda model: tied_skip(model.tied_parameters()),
)
CURVATURE_METHODS = {method.name: method for method in (KFAC, SHAMPOO)}


def method_of(config: RunConfig) -> CurvatureMethod:
    """The run's curvature method; K-FAC for first-order runs (what `pipefisher profile` measures)."""
    return CURVATURE_METHODS.get(config.optimizer.name, KFAC)
