"""Shampoo in the executor: handlers of SA, IA/IB and X, the providers of its collectives, the
gradient capture after a stage's last backward and the preconditioning before the optimizer step.

Refresh cycle of k steps (`Plan.steps`): after the last backward of a stage in the cycle's first
step, every Shampoo matrix's gradient is copied (unscaled by fp16's loss scale); on a replicated
stage a sync (SA) all-reduces the copy over all replicas (pipes x data-parallel), so it is the
step's whole gradient, as in the single-process reference. IA/IB fold it into the left/right
statistics and compute their inverse 4th roots; with split refresh work each replica computes
some roots, folds the statistics of the others at its exchange (X) and receives their roots by
broadcast. After the cycle's last step the new roots are committed: used from the next cycle on
(the first cycle steps with the grafting direction alone). Preconditioning needs the reduced
gradient (grafting is not linear), so it runs in the step end, right before the SGD step; with
`ShampooConfig.helpers` (one pipeline, a process per rank) a P op after the stage's last backward
takes its products first, and some matrices' products on other ranks (help ops,
`pipefisher.methods.shampoo.helping`), and the step end reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.profile import time_key
from pipefisher.core.op_fields import layer_of, part_of
from pipefisher.methods.blocks import FACTORS, Factor
from pipefisher.methods.help_exchange import HelpExchange, help_launchers
from pipefisher.methods.inputs import MethodInputs
from pipefisher.methods.interface import LayerMeasurement, StageRuntime, StageTimer
from pipefisher.methods.shampoo.engine import ShampooEngine
from pipefisher.methods.shampoo.helping import ShampooHelping
from pipefisher.methods.shampoo.state import is_matrix, trainable_parameters
from pipefisher.planning.comm.actions import Collective, CollectiveKind
from pipefisher.planning.plan import Plan
from pipefisher.runtime.primitives.clock import timed_ms
from pipefisher.runtime.primitives.comm import Handle
from pipefisher.runtime.primitives.sharding import is_sharded


def shampoo_engine(config: MethodInputs[Any], module: nn.Module, skip: tuple[str, ...]) -> ShampooEngine:
    """The engine of the run's shampoo section for `module`: Adam grafting takes optimizer.betas[1]
    and optimizer.eps; it holds only the matrices unless the rest steps with Shampoo's SGD
    (`ShampooConfig.matrices_only`)."""
    return ShampooEngine(
        module,
        config.settings,
        skip,
        graft_beta2=config.betas[1],
        graft_epsilon=config.eps,
        matrices_only=config.settings.matrices_only,
    )


def matrix_names(module: nn.Module, skip: tuple[str, ...]) -> list[str]:
    """Parameters of `module` that Shampoo preconditions, in order, without allocating anything
    (works on the meta device)."""
    return [name for name, parameter in trainable_parameters(module).items() if is_matrix(name, parameter, skip)]


class ShampooRuntime(StageRuntime[ShampooEngine]):
    """The Shampoo state of one rank's stages, the handlers of its op kinds and the providers of
    its collectives. `loss_scale()`: fp16's current loss scale (None otherwise); the captured
    gradient is divided by it."""

    engine_parts = FACTORS

    named_sections = ("exp_avg_sq", "matrices")
    cycle_slots = ("captured", "*/pending")
    build_engine = staticmethod(shampoo_engine)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: (pipe, stage, matrix) -> statistics this rank still folds from the captured gradient
        self._unfolded: dict[tuple[int, int, str], int] = {}

    def set_plan(self, plan: Plan | None) -> None:
        super().set_plan(plan)
        self.helping = ShampooHelping.of_runtime(plan, self)
        self.exchange_help = HelpExchange(self.comm, self.rank, self.helping, self.engine_of_stage)

    def handlers(self) -> dict[OpKind, Callable[[Op], None]]:
        return {
            OpKind.SYNC: lambda op: None,  # the launch is the whole op
            OpKind.REFRESH: self._refresh,
            OpKind.EXCHANGE: self._fold_shared,
            OpKind.PRECONDITION: self._hold_products,
            OpKind.HELP: lambda op: self.helping.help(op.stage, layer_of(op)),
        }

    def collectives(self) -> dict[CollectiveKind, Callable[[Collective], Handle]]:
        return {
            CollectiveKind.SYNC: self._launch_sync,
            CollectiveKind.EXCHANGE: self._launch_exchange,
            **help_launchers(lambda: self.exchange_help),
        }

    def after_backward(self, op: Op, cycle_step: int) -> None:
        """After the op that completes the stage's gradient in the cycle's first step (its last
        backward, or weight gradient, in whatever order the plan runs them): keep the gradient."""
        if not self.stage_gradient_final(op) or cycle_step != 0:
            return
        engine = self.engine(op)
        scale = self.loss_scale()
        for info in engine.matrices():
            engine.capture(info.name)
            if scale is not None:
                engine.captured_gradient(info.name).div_(scale)
            self._unfolded[(op.pipe, op.stage, info.name)] = 2

    def before_optimizer_step(self, updates: Callable[[nn.Parameter], bool]) -> None:
        for engine in self.engines.values():
            engine.precondition_all(updates)

    def end_of_cycle(self) -> None:
        """Commit the cycle's roots; report numerical trouble (one host read per stage)."""
        for engine in self.engines.values():
            engine.commit()
            engine.check_health()

    def cycle_state(self) -> dict:
        """The captured gradients not yet folded into both factors' statistics; the roots this
        rank holds for the cycle as a helper of other ranks' matrices."""
        state: dict = {
            "unfolded": [[pipe, stage, name, count] for (pipe, stage, name), count in self._unfolded.items()]
        }
        held = self.helping.cycle_state()
        return {**state, "helped": held} if held else state

    def load_cycle_state(self, state: dict) -> None:
        self._unfolded = {(pipe, stage, name): count for pipe, stage, name, count in state["unfolded"]}
        self.helping.load_cycle_state(state.get("helped", {}))

    def _hold_products(self, op: Op) -> None:
        """The P op: the products of the stage's matrices that no other rank multiplies; none on a
        replicated or sharded stage (a plan packed for another layout), whose step end takes them
        from the reduced gradient."""
        engine, handed = self.engine(op), self.helping.handed_names(op.stage)
        if len(self.topology.replica_ranks(op.stage)) > 1 or any(
            is_sharded(p) for p in self.modules[(op.pipe, op.stage)].parameters()
        ):
            return
        engine.hold_products([info.name for info in engine.matrices() if info.name not in handed])

    # -- handlers ----------------------------------------------------------------------------
    def _fold(self, op: Op, factor: Factor) -> ShampooEngine:
        engine, layer = self.engine(op), layer_of(op)
        engine.update_statistics(layer, factor)
        key = (op.pipe, op.stage, layer)
        self._unfolded[key] -= 1
        if not self._unfolded[key]:
            del self._unfolded[key]
            engine.release(layer)
        return engine

    def _refresh(self, op: Op) -> None:
        factor = FACTORS[part_of(op)]
        self._fold(op, factor).compute_root(layer_of(op), factor)

    def _fold_shared(self, op: Op) -> None:
        """A replica that did not compute a factor's roots still folds its statistics, so every
        replica keeps the same state; the roots themselves come by broadcast."""
        for part, factor in enumerate(FACTORS):
            if not self.owns(op, part):
                self._fold(op, factor)

    # -- collectives -------------------------------------------------------------------------
    def _launch_sync(self, collective: Collective) -> Handle:
        stage, layer, _ = collective.key
        return self.all_reduce(collective, [self.engine_of_stage[stage].captured_gradient(layer)])

    def _launch_exchange(self, collective: Collective) -> Handle:
        return self.exchange(
            collective, ShampooEngine.shared_root, ShampooEngine.root_buffer, ShampooEngine.receive_root
        )


class ShampooTimer(StageTimer[ShampooEngine]):
    """Shampoo's task times per matrix: statistics and roots of each factor (from a random
    gradient), the gradient's all-reduce over a replicated stage's group; and, in the step end,
    the preconditioning with grafting (with roots in place). With `helpers` also each matrix's
    products (`precondition`, the P op's), and the step end then reads products held before it,
    as the run's does."""

    method = "shampoo"
    build_engine = staticmethod(shampoo_engine)

    def before_optimizer_step(self) -> None:
        for engine in self.engines.values():
            if self.config is not None and self.config.settings.helpers:
                for info in engine.matrices():
                    engine.product_buffer(info.name)  # held by `measure`: the step end reads them
            engine.precondition_all()

    def measure(self, executor) -> dict[tuple[int, str], LayerMeasurement]:
        device = executor.device
        measurements: dict[tuple[int, str], LayerMeasurement] = {}
        for pipe, stage, engine in self.by_stage():
            group = self.sync_group(executor, stage)
            parameters = dict(self.modules[(pipe, stage)].named_parameters())
            for info in engine.matrices():
                parameter = parameters[info.name]
                saved = parameter.grad
                parameter.grad = torch.randn_like(parameter)
                engine.capture(info.name)
                parameter.grad = saved
                samples: dict[str, list[float]] = {}
                for part, factor in enumerate(FACTORS):

                    def refresh(factor: Factor = factor) -> None:
                        engine.update_statistics(info.name, factor)
                        engine.compute_root(info.name, factor)

                    samples[time_key("refresh", part)] = timed_ms(refresh, device)
                if group is not None:
                    gradient = engine.captured_gradient(info.name)
                    samples[time_key("sync", 0)] = timed_ms(lambda: dist.all_reduce(gradient, group=group), device)
                engine.release(info.name)
                measurements[(stage, info.name)] = (samples, {})
            engine.commit()
            if self.config is not None and self.config.settings.helpers:
                for info in engine.matrices():
                    parameter = parameters[info.name]
                    saved, parameter.grad = parameter.grad, torch.randn_like(parameter)
                    samples = measurements[(stage, info.name)][0]
                    samples["precondition"] = timed_ms(lambda: engine.hold_products([info.name]), device)
                    parameter.grad = saved
        return measurements
