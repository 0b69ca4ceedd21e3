"""A curvature method defined outside the package, the proof that a method is a plugin: a diagonal
second-moment preconditioner refreshed in the bubbles.

Per parameter p (tied copies stay first-order, as Shampoo keeps them), from the whole gradient g of
each refresh cycle's first step: v ← β·v + (1 − β)·g² (one statistic per parameter: the method has
one part, A), its refresh result s = 1 / (√v + ε), used from the next cycle on, and every step the
reduced, clipped gradient becomes s ⊙ g before the SGD step; the other parameters (the tied
copies) step with the section's `first_order` rule. Its run-file section is `diagonal`.

Importing this module registers the method (spawned ranks import it when they unpickle the run's
config); tests that only want it for a while use `registered()`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipefisher.core.ir import Op, OpKind, splits_backward
from pipefisher.core.settings import setting
from pipefisher.methods.interface import (
    CurvatureRuntime,
    MethodParts,
    ReferenceCurvature,
    TaskTimer,
    broadcast_from_owner,
    tied_copies,
)
from pipefisher.methods.method import CurvatureMethod, TaskRules, WorkLabels
from pipefisher.methods.registry import register, unregister
from pipefisher.methods.settings import RefreshConfig
from pipefisher.planning.comm.actions import Collective, CollectiveKind
from pipefisher.planning.comm.plan import inverse_owners


@dataclass(frozen=True)
class DiagonalConfig(RefreshConfig):
    """`beta2`: decay of the second moment; `epsilon`: added to its square root, large enough that
    a gradient that is zero in exact arithmetic (the attention's key biases: rounding noise,
    summed in another order by replicas) is not amplified into a full step (scale at most 1/ε)."""

    beta2: float = setting(0.5, "decay of the second moment", low=0, high=1, high_open=True)
    epsilon: float = setting(0.1, "added to the square root of the second moment", low=0, low_open=True)


def parameter_names(module: nn.Module, skip: tuple[str, ...]) -> list[str]:
    return [
        name
        for name, p in module.named_parameters()
        if p.requires_grad and not any(fnmatch(name, glob) for glob in skip)
    ]


class DiagonalState:
    """The method's state of one module: per parameter the captured gradient, v, and the pending
    and in-use scales (None until the first commit: the first cycle steps unpreconditioned)."""

    def __init__(self, module: nn.Module, settings: DiagonalConfig, skip: tuple[str, ...]):
        self.settings = settings
        self.parameters = {name: p for name, p in module.named_parameters() if name in parameter_names(module, skip)}
        self.captured: dict[str, Tensor] = {}
        self.second_moment = {name: torch.zeros_like(p) for name, p in self.parameters.items()}
        self.pending: dict[str, Tensor] = {}
        self.scale: dict[str, Tensor] = {}

    def capture(self, loss_scale: Tensor | None) -> None:
        for name, p in self.parameters.items():
            self.captured[name] = p.grad.detach().clone() if loss_scale is None else p.grad.detach() / loss_scale

    def fold(self, name: str) -> None:
        """v ← β·v + (1 − β)·g², then forget g."""
        beta = self.settings.beta2
        self.second_moment[name].mul_(beta).addcmul_(self.captured[name], self.captured[name], value=1 - beta)
        del self.captured[name]

    def refresh(self, name: str) -> None:
        self.fold(name)
        self.pending[name] = 1 / (self.second_moment[name].sqrt() + self.settings.epsilon)

    def commit(self) -> None:
        self.scale.update(self.pending)
        self.pending = {}

    def precondition(self, keep: Callable[[nn.Parameter], bool] = lambda p: True) -> None:
        for name, scale in self.scale.items():
            p = self.parameters[name]
            if p.grad is not None and keep(p):
                p.grad.mul_(scale)

    def state_dict(self) -> dict:
        return {
            "second_moment": self.second_moment,
            "scale": self.scale,
            "pending": self.pending,
            "captured": self.captured,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("second_moment", "scale", "pending", "captured"):
            setattr(self, key, {name: tensor.clone() for name, tensor in state[key].items()})


class DiagonalRuntime(CurvatureRuntime):
    """One rank's diagonal state over its stages: captures the stage's gradient after its last
    backward of a cycle's first step; SA all-reduces it over the stage's replicas; IA folds it and
    computes the scale on the owner; X folds it elsewhere and receives the owner's scale."""

    named_sections = ("second_moment", "scale", "pending", "captured")

    def __init__(self, config, topology, rank, modules, comm, plan, skip=(), loss_scale=lambda: None):
        self.topology, self.rank, self.comm, self.loss_scale = topology, rank, comm, loss_scale
        self.engines = {key: DiagonalState(module, config.settings, skip) for key, module in modules.items()}
        self._state_of_stage = {stage: state for (_, stage), state in self.engines.items()}
        ops = topology.schedule.ranks[topology.pipeline_rank(rank)]
        self._final_kind = OpKind.WEIGHT if splits_backward(ops) else OpKind.BACKWARD
        self._gradient_ops = Counter((op.pipe, op.stage) for op in ops if op.kind is self._final_kind)
        self._gradient_ops_run: Counter = Counter()
        self.set_plan(plan)

    def set_plan(self, plan) -> None:
        self.owners = inverse_owners(plan)

    def handlers(self) -> dict[OpKind, Callable[[Op], None]]:
        return {
            OpKind.SYNC: lambda op: None,
            OpKind.REFRESH: lambda op: self.engines[(op.pipe, op.stage)].refresh(op.layer),
            OpKind.EXCHANGE: self._fold_shared,
        }

    def collectives(self) -> dict[CollectiveKind, Callable[[Collective], Any]]:
        return {CollectiveKind.SYNC: self._launch_sync, CollectiveKind.EXCHANGE: self._launch_exchange}

    def after_backward(self, op: Op, cycle_step: int) -> None:
        key = (op.pipe, op.stage)
        if op.kind is not self._final_kind:
            return
        self._gradient_ops_run[key] += 1
        if self._gradient_ops_run[key] < self._gradient_ops[key]:
            return
        self._gradient_ops_run[key] = 0
        if cycle_step == 0:
            self.engines[key].capture(self.loss_scale())

    def before_optimizer_step(self, updates: Callable[[nn.Parameter], bool]) -> None:
        for state in self.engines.values():
            state.precondition(updates)

    def end_of_cycle(self) -> None:
        for state in self.engines.values():
            state.commit()

    def _fold_shared(self, op: Op) -> None:
        if self.owners[(op.stage, op.layer, 0)] != op.pipe:
            self.engines[(op.pipe, op.stage)].fold(op.layer)

    def _launch_sync(self, collective: Collective):
        stage, name, _ = collective.key
        return self.comm.all_reduce([self._state_of_stage[stage].captured[name]], collective.group)

    def _launch_exchange(self, collective: Collective):
        stage, name, _ = collective.key
        state = self._state_of_stage[stage]
        parameter = state.parameters[name]
        return broadcast_from_owner(
            self.comm,
            self.topology,
            self.rank,
            self.owners[(stage, name, 0)],
            collective,
            shared=lambda: state.pending[name],
            buffer=lambda: torch.empty_like(parameter),
            receive=lambda tensor: state.pending.__setitem__(name, tensor),
        )


class DiagonalTimer(TaskTimer):
    """Per parameter: the refresh (fold and scale, from a random gradient) and the all-reduce of
    the gradient over a replicated stage's group; and the preconditioning in the step end."""

    method = "diagonal"

    def __init__(self, config, modules, skip=()):
        self.engines = {key: DiagonalState(module, config.settings, skip) for key, module in modules.items()}

    def before_optimizer_step(self) -> None:
        for state in self.engines.values():
            state.precondition()

    def measure(self, executor) -> dict:
        from pipefisher.runtime.primitives.clock import timed_ms

        measurements = {}
        for (pipe, stage), state in sorted(self.engines.items(), key=lambda item: (item[0][1], item[0][0])):
            group = executor.comm.groups.get(("curv", stage))
            for name, parameter in state.parameters.items():

                def refresh(name: str = name, parameter: nn.Parameter = parameter) -> None:
                    state.captured[name] = torch.randn_like(parameter)
                    state.refresh(name)

                samples = {"refresh.0": timed_ms(refresh, executor.device)}
                if group is not None:
                    gradient = torch.randn_like(parameter)
                    samples["sync.0"] = timed_ms(lambda: dist.all_reduce(gradient, group=group), executor.device)
                measurements[(stage, name)] = (samples, {})
            state.commit()
        return measurements


class ReferenceDiagonal(ReferenceCurvature):
    """The same method on the whole model in one process."""

    def __init__(self, config, model, modules: nn.Module):
        super().__init__(config, model, modules)
        self.state = DiagonalState(modules, config.settings, tied_copies(model))
        self._loss_scale = None

    def capture(self, step: int, micro_batch: int, loss_scale=None):
        self._loss_scale = loss_scale
        return super().capture(step, micro_batch, loss_scale)

    def after_step_backwards(self, step: int) -> None:
        if step % self.k == 0:
            self.state.capture(self._loss_scale)
            for name in self.state.parameters:
                self.state.refresh(name)

    def before_optimizer_update(self, step: int) -> None:
        self.state.precondition()

    def after_optimizer_step(self, step: int) -> None:
        if step % self.k == self.k - 1:
            self.state.commit()


PARTS = MethodParts(
    runtime=DiagonalRuntime,
    timer=DiagonalTimer,
    layer_names=parameter_names,
    skip=tied_copies,
    reference=ReferenceDiagonal,
    preconditioned=lambda config, module, skip: parameter_names(module, skip),
)
DIAGONAL = CurvatureMethod(
    name="diagonal",
    label="Diagonal",
    rules=TaskRules(
        curvature=False,
        syncs=(0,),
        sync_of=((0, 0),),
        precondition=False,
        labels=WorkLabels(parts=("squared gradients",), refresh="second moment"),
    ),
    settings=DiagonalConfig,
    parts=f"{__name__}:PARTS",
    flags=("beta2",),
)
register(DIAGONAL)


@contextmanager
def registered() -> Iterator[CurvatureMethod]:
    """The method known while the context lasts (this process only)."""
    register(DIAGONAL)
    try:
        yield DIAGONAL
    finally:
        unregister(DIAGONAL.name)
