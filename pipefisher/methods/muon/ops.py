"""Muon in the executor: the P op of a stage with one replica, the share-and-broadcast of a
replicated stage (``pgrad``), the commit before the optimizer step, and its task timer.

A stage held once (no other pipe, no data-parallel copy): its gradient of the step is final after
its last backward (or weight gradient), where the plan puts its P op; P computes each matrix's new
momentum and orthogonalised update from the gradient divided by fp16's loss scale, before
clipping. A replicated stage's gradient is final only once reduced over the replicas, and the
orthogonalisation is not linear, so there is no P op (`MuonConfig.gradient_workers`): after the
reduction each replica orthogonalises its share of the matrices (one gradient worker per matrix,
round-robin, `GradWorkers`) and broadcasts the updates to the others. Either way the new momentum
is committed, and each update put in its parameter's ``.grad``, only when the step goes ahead
(`before_optimizer_step` is not called on an fp16 overflow).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from pipefisher.config import RunConfig
from pipefisher.core.ir import Op, OpKind
from pipefisher.core.topology import Topology
from pipefisher.methods.interface import CurvatureRuntime, LayerMeasurement, TaskTimer, tied_copies
from pipefisher.methods.muon.engine import MuonEngine, linear_weights
from pipefisher.planning.comm.actions import Collective, CollectiveKind
from pipefisher.planning.replicas.kaisa import GradWorkers
from pipefisher.planning.plan import Plan
from pipefisher.runtime.primitives.clock import timed_ms
from pipefisher.runtime.primitives.comm import Comm, Handle


def first_order_globs(model) -> tuple[str, ...]:
    """Globs of the weights Muon leaves first-order: the model's first-order linear layers and the
    tied copies (their gradient is whole only after the tied sum at the end of the step)."""
    return tuple(sorted({f"*{name}.weight" for name in model.first_order_linears()} | set(tied_copies(model))))


def matrix_names(module: nn.Module, skip: tuple[str, ...]) -> list[str]:
    """The parameters of `module` Muon updates, in order (works on the meta device)."""
    return list(linear_weights(module, skip))


def share_grid(topology: Topology, stage: int) -> GradWorkers | None:
    """Who orthogonalises which matrix of a replicated `stage`: one worker each (None: one replica)."""
    ranks = topology.replica_ranks(stage)
    return GradWorkers(tuple(sorted(ranks)), 1) if len(ranks) > 1 else None


class MuonRuntime(CurvatureRuntime):
    """Muon's state of one rank's stages (see the module docstring). `loss_scale()`: fp16's current
    loss scale (None otherwise)."""

    def __init__(
        self,
        config: RunConfig,
        topology: Topology,
        rank: int,
        modules: dict[tuple[int, int], nn.Module],
        comm: Comm,
        plan: Plan,
        skip: tuple[str, ...] = (),
        loss_scale: Callable[[], Tensor | None] = lambda: None,
    ):
        self.rank, self.comm, self.loss_scale = rank, comm, loss_scale
        self.engines = {key: MuonEngine(module, config.muon, skip) for key, module in modules.items()}
        #: a rank holds at most one copy of a stage
        self._engine_of_stage = {stage: engine for (_, stage), engine in self.engines.items()}
        self.grids = {
            stage: grid for stage in self._engine_of_stage if (grid := share_grid(topology, stage)) is not None
        }

    def handlers(self) -> dict[OpKind, Callable[[Op], None]]:
        return {OpKind.PRECONDITION: self._orthogonalise_stage}

    def collectives(self) -> dict[CollectiveKind, Callable[[Collective], Handle]]:
        return {CollectiveKind.PGRAD: self._launch_share}

    def before_optimizer_step(self, updates: Callable[[nn.Parameter], bool]) -> None:
        for engine in self.engines.values():
            engine.apply(updates)

    def end_of_cycle(self) -> None:
        """Nothing to commit: Muon has no refresh results."""

    def keeps(self, stage: int, name: str) -> bool:
        return name in self.own_share(stage) or name not in self._engine_of_stage[stage].names()

    def own_share(self, stage: int) -> list[str]:
        """The matrices of `stage` this rank orthogonalises (all of them on an unreplicated stage)."""
        names = self._engine_of_stage[stage].names()
        grid = self.grids.get(stage)
        return names if grid is None else [names[number] for number in grid.layers_of(self.rank, len(names))]

    def _orthogonalise_stage(self, op: Op) -> None:
        engine = self.engines[(op.pipe, op.stage)]
        for name in engine.names():
            engine.orthogonalise(name, self.loss_scale())

    def _launch_share(self, collective: Collective) -> Handle:
        """Orthogonalise this rank's share of the stage's matrices from the reduced gradient, then
        every matrix's worker broadcasts its update to the stage's replicas."""
        stage = collective.key[0]
        engine, grid = self._engine_of_stage[stage], self.grids[stage]
        for name in self.own_share(stage):
            engine.orthogonalise(name, self.loss_scale())
        pairs = [(engine.update_buffer(name), grid.worker(number, 0)) for number, name in enumerate(engine.names())]
        return self.comm.broadcast(pairs, collective.group)


class MuonTimer(TaskTimer):
    """Muon's task time per matrix (`precondition`: its momentum step and orthogonalisation, from a
    random gradient, after one untimed call that allocates its buffers) and, in the step end, the commit; on a replicated stage the step end also
    orthogonalises this rank's share, where the run does it (the broadcast is not timed)."""

    method = "muon"

    def __init__(self, config: RunConfig, modules: dict[tuple[int, int], nn.Module], skip: tuple[str, ...] = ()):
        self.config, self.modules = config, modules
        self.engines = {key: MuonEngine(module, config.muon, skip) for key, module in modules.items()}  # throwaway
        self._shares: dict[tuple[int, int], list[str]] = {}

    def before_optimizer_step(self) -> None:
        for key, engine in self.engines.items():
            for name in self._shares.get(key, ()):
                engine.orthogonalise(name)
            engine.apply()

    def measure(self, executor) -> dict[tuple[int, str], LayerMeasurement]:
        topology, rank = executor.topology, executor.rank
        measurements: dict[tuple[int, str], LayerMeasurement] = {}
        for (pipe, stage), engine in sorted(self.engines.items(), key=lambda item: (item[0][1], item[0][0])):
            for name, matrix in engine.matrices.items():
                gradient = torch.randn_like(matrix.parameter)
                engine.orthogonalise(name, gradient=gradient)  # allocates the matrix's buffers: not timed
                samples = timed_ms(lambda: engine.orthogonalise(name, gradient=gradient), executor.device)
                measurements[(stage, name)] = ({"precondition": samples}, {})
            grid = share_grid(topology, stage)
            if grid is not None:
                names = engine.names()
                self._shares[(pipe, stage)] = [names[number] for number in grid.layers_of(rank, len(names))]
        return measurements
