"""K-FAC in the executor: handlers of CA/CB, IA/IB, X and P, and the providers of its collectives
(factor syncs, inverse exchanges), over per-stage engines.

Refresh cycle of k steps (`Plan.steps`): the first step captures every micro-batch's a and e
while it runs forward/backward; curvature, factor syncs, inverses and exchanges run where the
plan puts them; after the last step of the cycle the new inverses are committed, so they are
used from the next cycle on (the first cycle preconditions with the identity). A sync (SA/SB) is
an all-reduce over all replicas of the stage (pipes x data-parallel copies) launched at its op
and waited for by the inverse; an exchange (X) broadcasts each inverse from the replica that
computed it. Preconditioning runs on each replica before the gradient all-reduce (it is linear in
the gradient, so the result is the same); under ZeRO-2/3 (FSDP2 reduce-scatters inside the stage's
last backward) it runs after the reduction instead, on the reduced gradients gathered whole, and
each replica keeps its shard of the result (`pipefisher.methods.kfac.step`). Nothing here reads a tensor on the host but the health
check at the end of a cycle (one read per stage).

With fewer gradient workers per layer than a stage has replicas (`kfac.grad_worker_fraction`,
`pipefisher.planning.replicas.kaisa`), only a layer's workers keep its inverses: an owner replica that is not a
worker inverts only when it is the exchange's source and forgets the result once sent; a
receiver that is not a worker drops what it received. There is no P op then: after the gradient
reduction each worker preconditions its layers and broadcasts them within its block (``pgrad``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.op_fields import layer_of, part_of
from pipefisher.core.profile import time_key
from pipefisher.methods.inputs import MethodInputs
from pipefisher.methods.interface import LayerMeasurement, StageRuntime, StageTimer
from pipefisher.methods.kfac.engine import KFACEngine
from pipefisher.methods.kfac.factors import damped_inverse, factor_dtype, precondition_matrix
from pipefisher.methods.help_exchange import HelpExchange, help_launchers
from pipefisher.methods.kfac.helping import KfacHelping
from pipefisher.methods.kfac.layer import FACTORS, Factor, LayerInfo
from pipefisher.methods.kfac.method import KFAC, KfacConfig
from pipefisher.models.tensor_parallel import applied_plan
from pipefisher.planning.comm.actions import Collective, CollectiveKind
from pipefisher.planning.replicas.kaisa import GradWorkers
from pipefisher.planning.plan import Plan
from pipefisher.runtime.primitives.clock import timed_ms
from pipefisher.runtime.primitives.comm import Handle


def kfac_engine(config: MethodInputs[KfacConfig], module: nn.Module, skip: tuple[str, ...]) -> KFACEngine:
    """The engine of the run's kfac section for `module`; B is scaled by the rows of the whole step
    (all micro-batches, all replicas), so every replica builds the same factor as the
    single-process reference."""
    return KFACEngine(module, config.settings, skip, grad_scale=float(config.rows_per_step))


class KfacRuntime(StageRuntime[KFACEngine]):
    """The K-FAC state of one rank's stages, the handlers of the K-FAC op kinds and the providers
    of its collectives. `loss_scale()`: fp16's current loss scale (None otherwise), recorded with
    every capture so that B is the factor of the unscaled loss."""

    cycle_slots = ("built", "captures", "loss_scales", "pending")
    result_slots = ("active",)
    build_engine = staticmethod(kfac_engine)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        topology = self.topology
        #: the (stage, layer, factor) statistics this rank's tensor-parallel processes build in shares
        self.shared_factors = share_rows(self.engine_of_stage, self.modules, self.comm.shard, topology.tensor_parallel)
        workers = self.config.workers_per_layer
        #: stage -> its gradient-worker grid, when a layer has fewer workers than the stage replicas
        self.grids = {
            stage: GradWorkers(topology.replica_ranks(stage), workers)
            for stage in self.engine_of_stage
            if workers is not None
        }
        #: stage -> layer name -> its number in the stage's layer order (the grid's layer numbers)
        self._numbers = {
            stage: {info.name: number for number, info in enumerate(engine.layers())}
            for stage, engine in self.engine_of_stage.items()
        }

    def set_plan(self, plan: Plan | None) -> None:
        """Use `plan` from the next cycle on (its inverse owners decide who computes what)."""
        super().set_plan(plan)
        ops = plan.curvature_ops() if plan is not None else ()
        self.exchanged = {(op.stage, op.layer) for op in ops if op.kind is OpKind.EXCHANGE}
        parameter = next(p for module in self.modules.values() for p in module.parameters())
        self.helping = KfacHelping.of_plan(plan, self.topology, self.rank).allocate(
            self.engine_of_stage, self.config.stage_modules, factor_dtype(parameter.dtype), parameter.device
        )
        self.exchange_help = HelpExchange(self.comm, self.rank, self.helping, self.engine_of_stage)

    def works_for(self, stage: int, layer: str) -> bool:
        """Whether this rank keeps `layer`'s inverses and preconditions it (every replica does
        without gradient workers)."""
        grid = self.grids.get(stage)
        return grid is None or grid.works_for(self.rank, self._numbers[stage][layer])

    def keeps(self, stage: int, name: str) -> bool:
        return name not in self._numbers[stage] or self.works_for(stage, name)

    def _exchange_source(self, stage: int, layer: str, factor: str) -> bool:
        return (stage, layer) in self.exchanged and self.rank == self.topology.rank(
            0, self.owner(stage, layer, FACTORS.index(factor)), stage
        )

    def handlers(self) -> dict[OpKind, Callable[[Op], None]]:
        table: dict[OpKind, Callable[[Op], None]] = {OpKind.CURVATURE: self._curvature}
        table[OpKind.SYNC] = lambda op: None  # the launch is the whole op
        table[OpKind.REFRESH] = self._invert
        table[OpKind.EXCHANGE] = self._fold_shared
        table[OpKind.PRECONDITION] = self._precondition
        table[OpKind.HELP] = lambda op: self.helping.layers[(op.stage, layer_of(op))].precondition()
        return table

    def collectives(self) -> dict[CollectiveKind, Callable[[Collective], Handle]]:
        return {
            CollectiveKind.SYNC: self._launch_sync,
            CollectiveKind.EXCHANGE: self._launch_exchange,
            CollectiveKind.PGRAD: self._launch_pgrad,
            **help_launchers(lambda: self.exchange_help),
        }

    def cycle_state(self) -> dict:
        """The inverses this rank holds for the cycle as a helper of other ranks' layers."""
        held = self.helping.cycle_state()
        return {"helped": held} if held else {}

    def load_cycle_state(self, state: dict) -> None:
        self.helping.load_cycle_state(state.get("helped", {}))

    def forward_context(self, op: Op, cycle_step: int) -> AbstractContextManager:
        """Context for the forward of `op`: records a and e in the cycle's first step."""
        if cycle_step != 0:
            return nullcontext()
        scale = self.loss_scale()
        return self.engine(op).capture(op.micro_batch, loss_scale=None if scale is None else scale.clone())

    def end_of_cycle(self) -> None:
        """Make the cycle's inverses the ones in use; report numerical trouble."""
        for engine in self.engines.values():
            for info in engine.layers():
                engine.commit(info.name)
            engine.check_health()

    # -- handlers ----------------------------------------------------------------------------
    def _curvature(self, op: Op) -> None:
        self.engine(op).curvature(layer_of(op), FACTORS[part_of(op)], op.micro_batch)

    def _invert(self, op: Op) -> None:
        factor, layer = FACTORS[part_of(op)], layer_of(op)
        decompose = self.works_for(op.stage, layer) or self._exchange_source(op.stage, layer, factor)
        self._sum_over_shards(op, factor)
        self.engine(op).invert(layer, factor, decompose=decompose)

    def _fold_shared(self, op: Op) -> None:
        """A replica that did not invert a factor still folds the synced factor into its running
        average, so every replica keeps the same state; the inverse itself comes by broadcast."""
        for part, factor in enumerate(FACTORS):
            if not self.owns(op, part):
                self._sum_over_shards(op, factor)
                self.engine(op).invert(layer_of(op), factor, decompose=False)

    def _sum_over_shards(self, op: Op, factor: Factor) -> None:
        """A statistic the rank's tensor-parallel processes built in shares: summed over them
        (blocking, inside the op that first reads it; `pipefisher.planning.comm.processes`)."""
        if (op.stage, layer_of(op), factor) in self.shared_factors:
            for tensor in self.engine(op).sync_tensors(layer_of(op), factor):
                self.comm.tensor_all_reduce(tensor)

    def _precondition(self, op: Op) -> None:
        engine, handed = self.engine(op), self.helping.handed_names(op.stage)
        layers = [info.name for info in engine.layers() if info.name not in handed] if handed else None
        engine.precondition_all(self.config.lr, layers=layers)

    # -- collectives -------------------------------------------------------------------------
    def _launch_sync(self, collective: Collective) -> Handle:
        stage, layer, part = collective.key
        return self.all_reduce(collective, list(self.engine_of_stage[stage].sync_tensors(layer, FACTORS[part])))

    def _launch_exchange(self, collective: Collective) -> Handle:
        stage, layer, part = collective.key
        factor = FACTORS[part]
        engine = self.engine_of_stage[stage]
        keeps = self.works_for(stage, layer)
        # With gradient workers the source may hold no inverse in use to fall back on: it sends
        # NaN for a failed inversion and the workers keep theirs
        workers = stage in self.grids
        return self.broadcast(
            collective,
            shared=lambda: (engine.fresh_inverse if workers else engine.shared_inverse)(layer, factor),
            buffer=lambda: engine.inverse_buffer(layer, factor),
            receive=lambda tensor: engine.receive_inverse(layer, factor, tensor, checked=workers) if keeps else None,
            sent=None if keeps else lambda: engine.discard_inverse(layer, factor),
        )

    def _launch_pgrad(self, collective: Collective) -> Handle:
        """Gradient workers: precondition this rank's layers of the stage (reduced gradients),
        then every layer's worker in the block broadcasts its preconditioned gradients."""
        stage = collective.key[0]
        engine, grid = self.engine_of_stage[stage], self.grids[stage]
        names = [info.name for info in engine.layers()]
        engine.precondition_all(
            self.config.lr, layers=[names[number] for number in grid.layers_of(self.rank, len(names))]
        )
        block = grid.block(self.rank)
        pairs = [
            (gradient, grid.worker(number, block))
            for number, name in enumerate(names)
            for gradient in engine.gradients(name)
        ]
        return self.comm.broadcast(pairs, collective.group)


def share_rows(
    engines: dict[int, KFACEngine], modules: dict[tuple[int, int], nn.Module], shard: int, degree: int
) -> frozenset[tuple[int, str, Factor]]:
    """Have each stage's engine build the factors its tensor-parallel shards share
    (`TaskRules.shared_statistics` of the split `parallelize` applied) from share `shard` of
    `degree` of the rows; returns them as (stage, layer, factor)."""
    applied = {name: split for (_, stage), module in modules.items() for name, split in applied_plan(module).items()}
    shared = KFAC.rules.shared_statistics(
        ((stage, info.name) for stage, engine in engines.items() for info in engine.layers()), applied
    )
    found = frozenset((stage, layer, FACTORS[part]) for stage, layer, part in shared)
    for stage, layer, factor in found:
        engines[stage].share_rows(layer, factor, shard, degree)
    return found


class KfacTimer(StageTimer[KFACEngine]):
    """K-FAC's task times: curvature per captured micro-batch of the profiler's last step, factor
    sync over the stage's replicas, eigen/Cholesky inverse of a factor's size, preconditioning;
    and the bytes of the largest micro-batch's captures of each layer. With gradient workers
    (fewer per layer than a stage's replicas) there is no P op: the step end preconditions this
    rank's share of the layers, where the run does it (the broadcast is not timed)."""

    method = "kfac"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: (pipe, stage) -> (gradient, A inverse, B inverse) of each layer this rank preconditions in its step end
        self._shares: dict[tuple[int, int], list[tuple[Tensor, Tensor, Tensor]]] = {}

    @property
    def step_end_work(self) -> bool:
        return bool(self._shares)

    def _worker_shares(self, executor) -> dict[tuple[int, int], set[int]]:
        """(pipe, stage) -> the numbers of the layers this rank preconditions as their gradient
        worker (the runtime's grid); {} without gradient workers."""
        workers = self.config.workers_per_layer if self.config is not None else None
        if workers is None:
            return {}
        found = {}
        for pipe, stage, engine in self.by_stage():
            grid = GradWorkers(executor.topology.replica_ranks(stage), workers)
            found[(pipe, stage)] = set(grid.layers_of(executor.rank, len(engine.layers())))
        return found

    @staticmethod
    def _refresh_samples(engine: KFACEngine, info: LayerInfo, factor: Factor, device: torch.device) -> list[float]:
        """The run's R op on this rank's own statistic (`KFACEngine.invert`: the mean over its
        rows, the running average, the damped inverse, its checks), three times; where no
        micro-batch was captured, on a random positive definite matrix of the factor's size."""
        if not engine.built_rows(info.name, factor):
            n = info.size(factor)
            matrix = torch.randn(n, n, device=device)
            matrix = matrix @ matrix.T / n + torch.eye(n, device=device)
            settings = engine.config
            return timed_ms(lambda: damped_inverse(matrix, settings.damping, settings.inverse), device)

        def invert() -> None:
            with engine.built_kept(info.name, factor):
                engine.invert(info.name, factor)

        return timed_ms(invert, device)

    def before_optimizer_step(self) -> None:
        for share in self._shares.values():
            for grad, a_inv, b_inv in share:
                precondition_matrix(grad, a_inv, b_inv)

    def build_engine(self, config: MethodInputs[Any], module: nn.Module, skip: tuple[str, ...]) -> KFACEngine:
        return KFACEngine(module, config.settings, skip=skip, grad_scale=1.0)  # B's scale does not change the time

    def forward_context(self, op: Op) -> AbstractContextManager:
        return self.engines[(op.pipe, op.stage)].capture(op.micro_batch)

    def measure(self, executor) -> dict[tuple[int, str], LayerMeasurement]:
        """Times as the run's engines work: a shared factor from this shard's share of the rows."""
        device = executor.device
        share_rows(
            {stage: engine for (_, stage), engine in self.engines.items()},
            self.modules,
            executor.comm.shard,
            executor.topology.tensor_parallel,
        )
        measurements: dict[tuple[int, str], LayerMeasurement] = {}
        shares = self._worker_shares(executor)
        for pipe, stage, engine in self.by_stage():
            group = self.sync_group(executor, stage)
            for number, info in enumerate(engine.layers()):
                samples: dict[str, list[float]] = {}
                sizes: dict[int, int] = {}
                for part, factor in enumerate(FACTORS):
                    micro_batches = engine.captured(info.name, factor)
                    sizes[part] = max(
                        (engine.captured_bytes(info.name, factor, micro_batch) for micro_batch in micro_batches),
                        default=0,
                    )
                    samples[time_key("curvature", part)] = [
                        timed_ms(lambda: engine.curvature(info.name, factor, micro_batch), device, repeats=1)[0]
                        for micro_batch in micro_batches
                    ]
                    samples[time_key("refresh", part)] = self._refresh_samples(engine, info, factor, device)
                    n = info.size(factor)
                    if group is not None:
                        buffer = torch.zeros(n, n, device=device)
                        samples[time_key("sync", part)] = timed_ms(lambda: dist.all_reduce(buffer, group=group), device)
                engine.release(info.name)
                grad = torch.randn(info.out_features, info.a_size, device=device)
                a_inv, b_inv = torch.eye(info.a_size, device=device), torch.eye(info.b_size, device=device)
                samples["precondition"] = timed_ms(lambda: precondition_matrix(grad, a_inv, b_inv), device)
                measurements[(stage, info.name)] = (samples, sizes)
                if (pipe, stage) in shares and number in shares[(pipe, stage)]:
                    self._shares.setdefault((pipe, stage), []).append((grad, a_inv, b_inv))
        return measurements
