"""The method's torch side on pipefisher's public blocks: per Linear weight (tied copies, biases and
the rest first-order) running means of a² per input (part 0) and e² per output feature (part 1)
from a cycle's first step; G becomes G[i, j]·rb[i]·ra[j], r = (mean + damping)^-1/2, from the next
cycle on."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.profile import time_key
from pipefisher.methods.capture import CapturedLayer, capture, rows_per_step
from pipefisher.methods.interface import LayerMeasurement, MethodParts, StageRuntime, StageTimer
from pipefisher.methods.layers import first_order_linears, linear_parameters, select_linears
from pipefisher.methods.reference import StageReference
from pipefisher.planning.comm.actions import Collective, CollectiveKind
from pipefisher.runtime.primitives.clock import timed_ms
from pipefisher.runtime.primitives.comm import Handle

LETTERS = ("A", "B")  #: the capture side of part 0 (the inputs a) and of part 1 (the output gradients e)


class Layer(CapturedLayer):
    """One layer's captures, the step's sums of squares, running means, pending and active scales."""

    def __init__(self, module: nn.Module, rows: int):
        super().__init__(module)
        self.rows = rows  # a "B" record times `rows` is the per-row gradient of the step's mean loss
        sizes = {"A": module.weight.shape[1], "B": module.weight.shape[0]}
        self.sums = {part: torch.zeros(n, dtype=torch.float64) for part, n in sizes.items()}
        self.mean = {part: torch.zeros(n, dtype=torch.float64) for part, n in sizes.items()}
        self.pending: dict[str, Tensor] = {}
        self.active: dict[str, Tensor] = {}

    def curvature(self, part: str, micro_batch: Hashable) -> None:
        records, scale = self.take(part, micro_batch)  # type: ignore[arg-type]
        for x in records:
            x = x.reshape(-1, x.shape[-1]).double()
            if part == "B":
                x = x * self.rows / (1.0 if scale is None else scale)
            self.sums[part] += (x * x).sum(0)

    def fold(self, part: str, decay: float) -> None:
        self.mean[part].mul_(decay).add_(self.sums[part] / self.rows, alpha=1 - decay)
        self.sums[part].zero_()

    def refresh(self, part: str, decay: float, damping: float) -> None:
        self.fold(part, decay)
        self.pending[part] = (self.mean[part] + damping).rsqrt()

    def precondition(self) -> None:
        grad = self.module.weight.grad
        if len(self.active) == 2 and grad is not None:
            grad.mul_(torch.outer(self.active["B"], self.active["A"]).to(grad.dtype))

    def state_dict(self) -> dict:
        return {"mean": self.mean, "active": self.active}


class Engine:
    """The method's state of one stage (or of the reference's whole model)."""

    def __init__(self, config, module: nn.Module, skip: tuple[str, ...]):
        self.settings = config.settings
        rows = rows_per_step(config)
        self.layers = {name: Layer(sel.module, rows) for name, sel in select_linears(module, skip).items()}

    def capture(self, micro_batch: Hashable, loss_scale=None) -> AbstractContextManager:
        return capture(self.layers, micro_batch, loss_scale)  # type: ignore[arg-type]

    def refresh(self, name: str, part: str) -> None:
        self.layers[name].refresh(part, self.settings.decay, self.settings.damping)

    def commit(self) -> None:
        for layer in self.layers.values():
            layer.active.update(layer.pending)
            layer.pending = {}

    def state_dict(self) -> dict:
        return {name: layer.state_dict() for name, layer in self.layers.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, layer_state in state.items():
            self.layers[name].mean, self.layers[name].active = layer_state["mean"], layer_state["active"]


class Runtime(StageRuntime[Engine]):
    """Curvature ops (C, by part) sum a micro-batch's squares, syncs (S) all-reduce them, refresh
    ops (R) refresh on the owner, X folds elsewhere and receives the owner's scales, P
    preconditions the stage."""

    build_engine = staticmethod(Engine)

    def handlers(self) -> dict[OpKind, Callable[[Op], None]]:
        curvature = lambda op: self.engine(op).layers[op.layer].curvature(LETTERS[op.part], op.micro_batch)
        refresh = lambda op: self.engine(op).refresh(op.layer, LETTERS[op.part])
        return {
            OpKind.CURVATURE: curvature,
            OpKind.SYNC: lambda op: None,
            OpKind.REFRESH: refresh,
            OpKind.EXCHANGE: self._fold,
            OpKind.PRECONDITION: lambda op: [layer.precondition() for layer in self.engine(op).layers.values()],
        }

    def collectives(self) -> dict[CollectiveKind, Callable[[Collective], Handle]]:
        return {CollectiveKind.SYNC: self._sync, CollectiveKind.EXCHANGE: self._exchange}

    def forward_context(self, op: Op, cycle_step: int) -> AbstractContextManager:
        return self.engine(op).capture(op.micro_batch, self.loss_scale()) if cycle_step == 0 else nullcontext()

    def end_of_cycle(self) -> None:
        for engine in self.engines.values():
            engine.commit()

    def _fold(self, op: Op) -> None:
        for part, letter in enumerate(LETTERS):
            if not self.owns(op, part):
                self.engine(op).layers[op.layer].fold(letter, self.config.settings.decay)

    def _sync(self, collective: Collective) -> Handle:
        stage, name, part = collective.key
        return self.all_reduce(collective, [self.engine_of_stage[stage].layers[name].sums[LETTERS[part]]])

    def _exchange(self, collective: Collective) -> Handle:
        stage, name, index = collective.key
        part, layer = LETTERS[index], self.engine_of_stage[stage].layers[name]
        return self.broadcast(
            collective,
            shared=lambda: layer.pending[part],
            buffer=lambda: torch.empty_like(layer.mean[part]),
            receive=lambda tensor: layer.pending.__setitem__(part, tensor),
        )


class Timer(StageTimer[Engine]):
    """Curvature per captured micro-batch of the profiler's last step, sync, refresh, precondition."""

    method = "diag_ggn"

    build_engine = staticmethod(Engine)

    def forward_context(self, op: Op) -> AbstractContextManager:
        return self.engines[(op.pipe, op.stage)].capture(op.micro_batch)

    def measure(self, executor) -> dict[tuple[int, str], LayerMeasurement]:
        found: dict[tuple[int, str], LayerMeasurement] = {}
        for _, stage, engine in self.by_stage():
            group = self.sync_group(executor, stage)
            for name, layer in engine.layers.items():
                samples: dict[str, list[float]] = {}
                for index, part in enumerate(LETTERS):
                    batches = layer.micro_batches(part)  # type: ignore[arg-type]
                    samples[time_key("curvature", index)] = [
                        timed_ms(lambda m=mb, p=part: layer.curvature(p, m), executor.device, repeats=1)[0]
                        for mb in batches
                    ]
                    refresh = lambda p=part: engine.refresh(name, p)
                    samples[time_key("refresh", index)] = timed_ms(refresh, executor.device)
                    if group is not None:
                        all_reduce = lambda s=layer.sums[part]: dist.all_reduce(s, group=group)
                        samples[time_key("sync", index)] = timed_ms(all_reduce, executor.device)
                samples["precondition"] = timed_ms(layer.precondition, executor.device)
                found[(stage, name)] = (samples, {})
        return found


class Reference(StageReference[Engine]):
    """The same on the whole model in one process: capture in a cycle's first step, refresh after
    its backwards, precondition every step (before the tied sum, as the P ops), commit at its end."""

    build_engine = staticmethod(Engine)

    def capture_context(self, micro_batch: int, loss_scale=None) -> AbstractContextManager:
        return self.engine.capture(micro_batch, loss_scale)

    def after_step_backwards(self, step: int) -> None:
        for name, layer in self.engine.layers.items():
            if self.first_of_cycle(step):
                for part in "AB":
                    for micro_batch in layer.micro_batches(part):  # type: ignore[arg-type]
                        layer.curvature(part, micro_batch)
                    self.engine.refresh(name, part)
            layer.precondition()

    def after_optimizer_step(self, step: int) -> None:
        if self.last_of_cycle(step):
            self.engine.commit()


PARTS = MethodParts(
    runtime=Runtime,
    timer=Timer,
    layer_names=lambda module, skip: list(select_linears(module, skip)),
    skip=first_order_linears,
    reference=Reference,
    preconditioned=lambda config, module, skip: linear_parameters(module, skip, bias=False),
)
