"""SOAP in the executor: handlers of IA/IB, X and U, the provider of its exchange, and its work
at each step's end.

Step end (before the optimizer step, every step, every replica alike): the reduced, clipped
gradient of each SOAP matrix becomes its direction (no sync: every replica of a stage holds the
same reduced gradient) and is folded into the statistics; with ``soap.fold: bubbles`` a copy of
it is held for the fold instead, which the stage's U op of the next step does wherever the packer
put it (in a bubble; the engine folds it first wherever the statistics are read before,
`SoapEngine.fold_held`). With the fold at the step end the U ops find nothing to fold.

Refresh cycle of k steps (`Plan.steps`): IA/IB compute the new left/right eigenbases of every
matrix (one power-iteration step with QR) from the statistics as of the cycle's start (the
snapshot taken at the previous cycle's end) and the bases in use, wherever the packer put them;
with split refresh work one replica computes each and its exchange (X) broadcasts it. After the
cycle's last step the new bases are committed (used from the next cycle on) and the statistics
are snapshotted for the next cycle.

With `SoapConfig.helpers` (one pipeline, a process per rank) a P op after the stage's last
backward rotates each matrix's gradient into its eigenbases, some matrices on other ranks (help
ops, `pipefisher.methods.soap.helping`), and the step end scales what it holds and rotates only
the direction out. A helped matrix without bases when they were sent (the run's first cycle) is
rotated by the step end itself for that cycle. The first step of the run takes the first bases by
eigendecomposition at its end and makes no step; the first cycle, without a snapshot, refreshes
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.profile import time_key
from pipefisher.core.op_fields import layer_of, part_of
from pipefisher.methods.blocks import FACTORS
from pipefisher.methods.inputs import MethodInputs
from pipefisher.methods.interface import LayerMeasurement, StageRuntime, StageTimer
from pipefisher.methods.help_exchange import HelpExchange, help_launchers
from pipefisher.methods.soap.engine import SoapEngine
from pipefisher.methods.soap.helping import SoapHelping
from pipefisher.methods.soap.state import matrix_parameters
from pipefisher.planning.comm.actions import Collective, CollectiveKind
from pipefisher.planning.plan import Plan
from pipefisher.runtime.primitives.clock import timed_ms
from pipefisher.runtime.primitives.comm import Handle
from pipefisher.runtime.primitives.sharding import is_sharded


def soap_engine(config: MethodInputs[Any], module: nn.Module, skip: tuple[str, ...]) -> SoapEngine:
    """The engine of the run's soap section for `module` (its statistics folded by the U ops when
    the section says `fold: bubbles`)."""
    return SoapEngine(module, config.settings, skip, defer_statistics=config.settings.fold == "bubbles")


def matrix_names(module: nn.Module, skip: tuple[str, ...]) -> list[str]:
    """Parameters of `module` that SOAP preconditions, in order, without allocating anything
    (works on the meta device)."""
    return list(matrix_parameters(module, skip))


class SoapRuntime(StageRuntime[SoapEngine]):
    """The SOAP state of one rank's stages, the handlers of its op kinds and the provider of its
    exchange. The loss scale is not needed: the step end sees unscaled gradients."""

    engine_parts = FACTORS

    named_sections = ("matrices",)
    cycle_slots = ("*/pending",)
    build_engine = staticmethod(soap_engine)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: stage -> its helped matrices whose bases the helper holds for this cycle (sent started)
        self._bases_sent: dict[int, set[str]] = {}

    def set_plan(self, plan: Plan | None) -> None:
        super().set_plan(plan)
        self.helping = SoapHelping.of_runtime(plan, self)
        self.exchange_help = HelpExchange(self.comm, self.rank, self.helping, self.engine_of_stage)

    def handlers(self) -> dict[OpKind, Callable[[Op], None]]:
        return {
            OpKind.REFRESH: self._refresh,
            OpKind.EXCHANGE: lambda op: None,  # its launches are the whole op
            OpKind.FOLD: self._fold,
            OpKind.PRECONDITION: self._hold_rotations,
            OpKind.HELP: lambda op: self.helping.help(op.stage, layer_of(op)),
        }

    def collectives(self) -> dict[CollectiveKind, Callable[[Collective], Handle]]:
        return {
            CollectiveKind.EXCHANGE: self._launch_exchange,
            **help_launchers(lambda: self.exchange_help),
        }

    def after_backward(self, op: Op, cycle_step: int) -> None:
        """At the op that completes the stage's gradient in the cycle's first step (when its
        ``help_state`` sends the bases in use, which change only at a step's end): note which
        helped matrices have bases."""
        if self.stage_gradient_final(op) and cycle_step == 0:
            engine = self.engine(op)
            handed = self.helping.handed_names(op.stage)
            self._bases_sent[op.stage] = {name for name in handed if engine.matrix_state(name).started}

    def cycle_state(self) -> dict:
        """The helped matrices whose bases the helpers hold for the cycle; the bases this rank
        holds as a helper of other ranks' matrices."""
        sent = [[stage, name] for stage, names in sorted(self._bases_sent.items()) for name in sorted(names)]
        held = self.helping.cycle_state()
        return {"sent": sent, "helped": held} if held or sent else {}

    def load_cycle_state(self, state: dict) -> None:
        self._bases_sent = {}
        for stage, name in state.get("sent", []):
            self._bases_sent.setdefault(stage, set()).add(name)
        self.helping.load_cycle_state(state.get("helped", {}))

    def before_optimizer_step(self, updates: Callable[[nn.Parameter], bool]) -> None:
        for engine in self.engines.values():
            engine.precondition_all(updates)

    def end_of_cycle(self) -> None:
        """Commit the cycle's bases, snapshot the statistics for the next cycle's refresh, report
        numerical trouble (one host read per stage)."""
        for engine in self.engines.values():
            engine.commit()
            engine.snapshot()
            engine.check_health()

    def _hold_rotations(self, op: Op) -> None:
        """The P op: the rotations of the stage's matrices that no other rank does, and the
        helped ones' that come back; none on a replicated or sharded stage (a plan packed for
        another layout), whose step end rotates the reduced gradient."""
        if len(self.topology.replica_ranks(op.stage)) > 1 or any(
            is_sharded(p) for p in self.modules[(op.pipe, op.stage)].parameters()
        ):
            return
        engine, handed = self.engine(op), self.helping.handed_names(op.stage)
        own = [info.name for info in engine.matrices() if info.name not in handed]
        engine.hold_rotations(own, received=sorted(handed & self._bases_sent.get(op.stage, set())))

    def _fold(self, op: Op) -> None:
        self.engine(op).fold_held()

    def _refresh(self, op: Op) -> None:
        self.engine(op).refresh(layer_of(op), FACTORS[part_of(op)])

    def _launch_exchange(self, collective: Collective) -> Handle:
        return self.exchange(collective, SoapEngine.shared_basis, SoapEngine.basis_buffer, SoapEngine.receive_basis)


class SoapTimer(StageTimer[SoapEngine]):
    """SOAP's task times per matrix: the refresh of each factor (from statistics and first bases
    of a random gradient) and, with ``fold: bubbles``, the fold of a gradient into the statistics
    (the U op's, the profile's ``fold``); in the step end, the direction with bases in
    place (and the fold, at ``fold: step-end``). With `helpers` also each matrix's rotation in
    (``precondition``, the P op's), and the step end then reads rotations held before it, as the
    run's does."""

    method = "soap"
    build_engine = staticmethod(soap_engine)

    def before_optimizer_step(self) -> None:
        for engine in self.engines.values():
            if self._helpers:  # rotations timed by `measure`: the step end scales held ones
                engine.hold_rotations([], received=[info.name for info in engine.matrices()])
            engine.precondition_all()
            engine.drop_held()  # a held gradient's fold is timed by `measure`, as the U op's

    @property
    def _helpers(self) -> bool:
        return self.config is not None and self.config.settings.helpers

    def measure(self, executor) -> dict[tuple[int, str], LayerMeasurement]:
        measurements: dict[tuple[int, str], LayerMeasurement] = {}
        for _, stage, engine in self.by_stage():
            parameters = engine.parameters()
            saved = [p.grad for p in parameters]
            for p in parameters:
                p.grad = torch.randn_like(p)
            engine.precondition_all()  # statistics and first bases
            for p, grad in zip(parameters, saved):
                p.grad = grad
            engine.snapshot()
            for info in engine.matrices():
                name = info.name
                samples = {
                    time_key("refresh", part): timed_ms(partial(engine.refresh, name, factor), executor.device)
                    for part, factor in enumerate(FACTORS)
                }
                if engine.defer_statistics:
                    gradient = torch.randn(info.shape, device=executor.device)
                    samples["fold"] = timed_ms(partial(engine.fold_into_statistics, name, gradient), executor.device)
                if self._helpers:
                    parameter = engine.matrix_state(name).parameter
                    saved_grad, parameter.grad = parameter.grad, torch.randn_like(parameter)
                    samples["precondition"] = timed_ms(partial(engine.hold_rotations, [name]), executor.device)
                    parameter.grad = saved_grad
                    engine.drop_held()
                measurements[(stage, info.name)] = (samples, {})
            engine.commit()
        return measurements
