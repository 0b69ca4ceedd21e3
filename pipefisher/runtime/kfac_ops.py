"""K-FAC ops in the executor: handlers for CA/CB, SA/SB, IA/IB, X and P over per-stage engines.

Refresh cycle of k steps (`Plan.steps`): the first step captures every micro-batch's a and e
while it runs forward/backward; curvature, factor syncs, inverses and exchanges run where the
plan puts them; after the last step of the cycle the new inverses are committed, so they are
used from the next cycle on (the first cycle preconditions with the identity). Syncs and
exchanges are asynchronous collectives over the stage's replica group, waited for by the ops
that need their result. Preconditioning runs on each replica before the gradient all-reduce
(it is linear in the gradient, so the result is the same).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from torch import nn

from pipefisher.config import RunConfig
from pipefisher.ir import Op, OpKind
from pipefisher.kfac import KFACConfig, KFACEngine
from pipefisher.kfac.engine import PendingWork
from pipefisher.plan import Plan
from pipefisher.runtime.comm import Comm
from pipefisher.runtime.topology import Topology
from pipefisher.tasks import FACTOR_OF

KFAC_KINDS = (OpKind.CURV_A, OpKind.CURV_B, OpKind.SYNC_A, OpKind.SYNC_B, OpKind.INV_A, OpKind.INV_B, OpKind.EXCHANGE, OpKind.PRECONDITION)


def kfac_engine_config(config: RunConfig, rows_per_step: int) -> KFACConfig:
    """Engine settings; B is scaled by the rows of the whole step (all micro-batches, all
    replicas), so every replica builds the same factor as the single-process reference."""
    k = config.kfac
    return KFACConfig(damping=k.damping, factor_decay=k.factor_decay, inverse=k.inverse, grad_scale=float(rows_per_step))


def rows_per_step(config: RunConfig) -> int:
    return config.pipeline.micro_batches * config.pipeline.data_parallel * config.data.micro_batch_size * config.model.seq_len


class KfacRuntime:
    """The K-FAC state of one rank's stages and the handlers of the K-FAC op kinds."""

    def __init__(self, config: RunConfig, topology: Topology, rank: int, modules: dict[tuple[int, int], nn.Module], comm: Comm, plan: Plan,
                 skip: tuple[str, ...] = ()):
        self.topology, self.rank, self.comm = topology, rank, comm
        engine_config = kfac_engine_config(config, rows_per_step(config))
        self.engines = {key: KFACEngine(module, engine_config, skip) for key, module in modules.items()}
        self.lr = config.optimizer.lr
        self.set_plan(plan)
        self._syncs: dict[tuple[int, int, str, str], PendingWork] = {}
        self._shares: list[PendingWork] = []

    def set_plan(self, plan: Plan) -> None:
        """Use `plan` from the next cycle on (its inverse owners decide who computes what)."""
        self.plan = plan
        self.owners: dict[tuple[int, str, str], int] = {}
        for op in plan.kfac_ops():
            if op.kind in (OpKind.INV_A, OpKind.INV_B):
                self.owners.setdefault((op.stage, op.layer, FACTOR_OF[op.kind]), op.pipe)

    def handlers(self) -> dict[OpKind, Callable[[Op], list]]:
        table = {kind: self._curvature for kind in (OpKind.CURV_A, OpKind.CURV_B)}
        table.update({kind: self._sync for kind in (OpKind.SYNC_A, OpKind.SYNC_B)})
        table.update({kind: self._invert for kind in (OpKind.INV_A, OpKind.INV_B)})
        table[OpKind.EXCHANGE] = self._exchange
        table[OpKind.PRECONDITION] = self._precondition
        return table

    def capture(self, op: Op, cycle_step: int) -> AbstractContextManager:
        """Context for the forward of `op`: records a and e in the cycle's first step."""
        if cycle_step != 0:
            return nullcontext()
        return self.engines[(op.pipe, op.stage)].capture(op.micro_batch)

    def quiesce(self) -> None:
        """Finish every collective in flight (before a checkpoint); the math is unchanged."""
        for work in [*self._syncs.values(), *self._shares]:
            work.wait()
        self._syncs.clear()
        self._shares.clear()

    def state_dict(self) -> dict:
        self.quiesce()
        return {f"{pipe}.{stage}": engine.state_dict() for (pipe, stage), engine in self.engines.items()}

    def load_state_dict(self, state: dict) -> None:
        for (pipe, stage), engine in self.engines.items():
            engine.load_state_dict(state[f"{pipe}.{stage}"])

    def end_of_cycle(self) -> None:
        """Finish outstanding exchanges and make the cycle's inverses the ones in use."""
        for work in self._shares:
            work.wait()
        self._shares.clear()
        if self._syncs:
            raise RuntimeError(f"factor syncs never waited for: {sorted(self._syncs)}")
        for engine in self.engines.values():
            for info in engine.layers():
                engine.commit(info.name)

    # -- handlers ----------------------------------------------------------------------------
    def _engine(self, op: Op) -> KFACEngine:
        return self.engines[(op.pipe, op.stage)]

    def _curvature(self, op: Op) -> list:
        self._engine(op).curvature(op.layer, FACTOR_OF[op.kind], op.micro_batch)
        return []

    def _group(self, stage: int):
        return self.comm.kfac_groups[self.topology.replica_ranks(stage)]

    def _sync(self, op: Op) -> list:
        factor = FACTOR_OF[op.kind]
        work = self._engine(op).start_sync(op.layer, factor, self._group(op.stage))
        self._syncs[(op.pipe, op.stage, op.layer, factor)] = work
        return []

    def _wait_sync(self, op: Op, factor: str) -> None:
        work = self._syncs.pop((op.pipe, op.stage, op.layer, factor), None)
        if work is not None:
            work.wait()

    def _invert(self, op: Op) -> list:
        factor = FACTOR_OF[op.kind]
        self._wait_sync(op, factor)
        self._engine(op).invert(op.layer, factor)
        return []

    def _exchange(self, op: Op) -> list:
        """Share the stage's inverses from the replicas that computed them; the others fold the
        synced factor into their running average so every replica keeps the same state."""
        engine = self._engine(op)
        for factor in ("A", "B"):
            owner = self.owners[(op.stage, op.layer, factor)]
            if owner != op.pipe:
                self._wait_sync(op, factor)
                engine.invert(op.layer, factor, decompose=False)
            source = self.topology.rank(0, owner, op.stage)
            self._shares.append(engine.start_share_inverse(op.layer, factor, source, self._group(op.stage)))
        return []

    def _precondition(self, op: Op) -> list:
        self._engine(op).precondition_all(self.lr)
        return []
