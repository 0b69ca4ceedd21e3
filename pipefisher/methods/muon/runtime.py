"""Muon in the executor: the P op of a stage with one replica (and its help ops, where the plan
hands matrices to another rank: `pipefisher.methods.muon.helping`), the share-and-broadcast of a
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

A sharded stage (ZeRO-2/3: its parameters and gradients FSDP2 DTensors, this rank's rows) is
gathered, orthogonalised and scattered, each replica the whole of it, in a P op as an unreplicated
stage's (`MuonConfig.gradient_workers` asks for every replica when sharded, so the plan has P ops
for the stage and packs them into bubbles): after the stage's last backward, FSDP2 has
reduce-scattered the gradients (and, under Chimera, they are summed over the pipes before P), P
all-gathers each matrix's reduced gradient (`whole_gradient`, in the engine's matrix order; the
plan names these gathers, ``unshard`` of the P op, so the replay checks their order), steps the
whole momentum and orthogonalises every matrix; the commit then writes this rank's rows of each
update into its gradient shard (`MuonEngine.apply`). The replicas compute the same updates from
the same gathered gradients, so nothing is broadcast: the share of the matrices among replicas is
traded for R x the Newton–Schulz work, and each replica holds every matrix's momentum and update
whole (2 x the stage's matrices, fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.topology import Topology
from pipefisher.methods.inputs import MethodInputs
from pipefisher.methods.interface import LayerMeasurement, StageRuntime, StageTimer, tied_copies
from pipefisher.core.op_fields import layer_of
from pipefisher.methods.muon.engine import MuonEngine, linear_weights, orthogonalise_into
from pipefisher.methods.muon.helping import Helping
from pipefisher.planning.comm.actions import Collective, CollectiveKind
from pipefisher.planning.plan import Plan
from pipefisher.planning.replicas.kaisa import GradWorkers
from pipefisher.runtime.primitives.clock import timed_ms
from pipefisher.runtime.primitives.comm import Handle
from pipefisher.runtime.primitives.sharding import is_sharded


def muon_engine(config: MethodInputs[Any], module: nn.Module, skip: tuple[str, ...]) -> MuonEngine:
    """The engine of the run's muon section for `module`."""
    return MuonEngine(module, config.settings, skip)


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


class MuonRuntime(StageRuntime[MuonEngine]):
    """Muon's state of one rank's stages (see the module docstring). `loss_scale()`: fp16's current
    loss scale (None otherwise). It has no refresh work: the plan's owners are not read."""

    build_engine = staticmethod(muon_engine)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.grids = {
            stage: grid for stage in self.engine_of_stage if (grid := share_grid(self.topology, stage)) is not None
        }
        #: the stages whose matrices are FSDP2 shards: every replica orthogonalises all of them
        self.sharded = {
            stage
            for stage, engine in self.engine_of_stage.items()
            if any(is_sharded(matrix.parameter) for matrix in engine.matrices.values())
        }

    def set_plan(self, plan: Plan | None) -> None:
        super().set_plan(plan)
        parameter = next(p for module in self.modules.values() for p in module.parameters())
        self.helping = Helping.of_plan(plan, self.topology, self.rank).allocate(
            self.config.stage_modules, parameter.dtype, parameter.device
        )

    def handlers(self) -> dict[OpKind, Callable[[Op], None]]:
        return {OpKind.PRECONDITION: self._orthogonalise_stage, OpKind.HELP: self._help}

    def collectives(self) -> dict[CollectiveKind, Callable[[Collective], Handle]]:
        return {
            CollectiveKind.PGRAD: self._launch_share,
            CollectiveKind.HELP_IN: self._launch_help_in,
            CollectiveKind.HELP_OUT: self._launch_help_out,
        }

    def before_optimizer_step(self, updates: Callable[[nn.Parameter], bool]) -> None:
        for engine in self.engines.values():
            engine.apply(updates)

    def end_of_cycle(self) -> None:
        """Nothing to commit: Muon has no refresh results."""

    def keeps(self, stage: int, name: str) -> bool:
        return name in self.own_share(stage) or name not in self.engine_of_stage[stage].names()

    def own_share(self, stage: int) -> list[str]:
        """The matrices of `stage` this rank orthogonalises (all of them on an unreplicated or a
        sharded stage)."""
        names = self.engine_of_stage[stage].names()
        grid = self.grids.get(stage)
        return (
            names
            if grid is None or stage in self.sharded
            else [names[number] for number in grid.layers_of(self.rank, len(names))]
        )

    def _orthogonalise_stage(self, op: Op) -> None:
        engine, handed = self.engine(op), self.helping.handed_names(op.stage)
        engine.orthogonalise([name for name in engine.names() if name not in handed], self.loss_scale())

    def _help(self, op: Op) -> None:
        """A matrix of another rank's stage: its direction, received, orthogonalised."""
        key = (op.stage, layer_of(op))
        orthogonalise_into([self.helping.outputs[key]], [self.helping.inputs[key]], self.config.settings)

    def _launch_help_in(self, collective: Collective) -> Handle:
        """The stage's rank steps the helped matrices' momentum and broadcasts their directions;
        the helper receives them (`pipefisher.methods.muon.helping`)."""
        (stage,), (_, owner, helper) = collective.key, collective.group
        if self.rank == owner:
            names = self.helping.handed[stage][helper]
            directions = self.engine_of_stage[stage].directions(names, self.loss_scale())
            return self.comm.broadcast([(direction, owner) for direction in directions], collective.group)
        names = self.helping.helped[(stage, owner)]
        return self.comm.broadcast([(self.helping.inputs[(stage, name)], owner) for name in names], collective.group)

    def _launch_help_out(self, collective: Collective) -> Handle:
        """The helper broadcasts its results; the stage's rank receives them into the matrices'
        update buffers."""
        (stage,), (_, owner, helper) = collective.key, collective.group
        if self.rank == owner:
            engine = self.engine_of_stage[stage]
            names = self.helping.handed[stage][helper]
            return self.comm.broadcast([(engine.update_buffer(name), helper) for name in names], collective.group)
        names = self.helping.helped[(stage, owner)]
        return self.comm.broadcast([(self.helping.outputs[(stage, name)], helper) for name in names], collective.group)

    def _launch_share(self, collective: Collective) -> Handle:
        """Orthogonalise this rank's share of the stage's matrices from the reduced gradient, then
        every matrix's worker broadcasts its update to the stage's replicas."""
        stage = collective.key[0]
        engine, grid = self.engine_of_stage[stage], self.grids[stage]
        engine.orthogonalise(self.own_share(stage), self.loss_scale())
        pairs = [(engine.update_buffer(name), grid.worker(number, 0)) for number, name in enumerate(engine.names())]
        return self.comm.broadcast(pairs, collective.group)


class MuonTimer(StageTimer[MuonEngine]):
    """Muon's task time per matrix (`precondition`: its momentum step and orthogonalisation, from a
    random gradient, after one untimed call that allocates its buffers) and, in the step end, the commit; on a replicated stage the step end also
    orthogonalises this rank's share, where the run does it (the broadcast is not timed)."""

    method = "muon"
    build_engine = staticmethod(muon_engine)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._shares: dict[tuple[int, int], list[str]] = {}

    def before_optimizer_step(self) -> None:
        for key, engine in self.engines.items():
            engine.orthogonalise(self._shares.get(key, []))
            engine.apply()

    def measure(self, executor) -> dict[tuple[int, str], LayerMeasurement]:
        topology, rank = executor.topology, executor.rank
        measurements: dict[tuple[int, str], LayerMeasurement] = {}
        for pipe, stage, engine in self.by_stage():
            for name, matrix in engine.matrices.items():
                gradient = torch.randn_like(matrix.parameter)
                engine.orthogonalise([name], gradients=[gradient])  # allocates the matrix's buffers: not timed
                samples = timed_ms(lambda: engine.orthogonalise([name], gradients=[gradient]), executor.device)
                measurements[(stage, name)] = ({"precondition": samples}, {})
            grid = share_grid(topology, stage)
            if grid is not None:
                names = engine.names()
                self._shares[(pipe, stage)] = [names[number] for number in grid.layers_of(rank, len(names))]
        return measurements
