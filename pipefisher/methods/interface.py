"""A curvature method on the executor: the interface K-FAC and Shampoo implement.

The plan says which op runs where (`pipefisher.methods.rules`); a method's runtime supplies the
handlers of its op kinds, the launchers of its collectives (``sync``, ``exchange``), its hooks
into the step (around forwards, after backwards, before the optimizer step), its end-of-cycle
commit and its checkpoint state. Its `TaskTimer` measures its tasks for the profiler.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from pipefisher.planning.comm.plan import Collective
from torch import Tensor, nn

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.topology import Topology
from pipefisher.planning.plan import Plan
from pipefisher.runtime.pipeline.comm import Comm, Handle

#: (time field -> samples in ms, capture_a_bytes/capture_b_bytes -> bytes) of one layer
LayerMeasurement = tuple[dict[str, list[float]], dict[str, int]]


def broadcast_from_owner(comm: Comm, topology: Topology, rank: int, owner_pipe: int, collective: Collective,
                         shared: Callable[[], Tensor], buffer: Callable[[], Tensor],
                         receive: Callable[[Tensor], None], sent: Callable[[], None] | None = None) -> Handle:
    """An exchange: the refresh result of `collective.key` = (stage, layer, factor) (an inverse, a
    root) goes from the owner pipe's rank of data-parallel replica 0 (`shared()`; `sent()` runs
    there once it is out) to the stage's other replicas, which receive into `buffer()` and hand it
    to `receive` once it arrived."""
    stage = collective.key[0]
    source = topology.rank(0, owner_pipe, stage)
    if rank == source:
        return comm.broadcast([(shared(), source)], collective.group, on_done=sent)
    target = buffer()
    return comm.broadcast([(target, source)], collective.group, on_done=lambda: receive(target))


class CurvatureRuntime:
    """One rank's state of a curvature method over its stages, and its part in every step."""

    def handlers(self) -> dict[OpKind, Callable[[Op], None]]:
        """Handlers of the method's op kinds."""
        raise NotImplementedError

    def collectives(self) -> dict[str, Callable[[Collective], Handle]]:
        """Launchers of its collectives by kind (``sync``, ``exchange``)."""
        raise NotImplementedError

    def forward_context(self, op: Op, cycle_step: int) -> AbstractContextManager:
        """Context the forward `op` runs in (K-FAC records its inputs in the cycle's first step)."""
        return nullcontext()

    def after_backward(self, op: Op, cycle_step: int) -> None:
        """Called after every backward (Shampoo keeps the stage's gradient of the cycle's first step)."""

    def before_optimizer_step(self, updates: Callable[[nn.Parameter], bool]) -> None:
        """Called on the reduced, clipped gradients right before the optimizer step (Shampoo
        preconditions there) with the test of the parameters this rank updates (ZeRO-1: only
        their gradients are reduced here); not called when fp16 overflowed."""

    def set_plan(self, plan: Plan) -> None:
        """Use `plan` from the next cycle on (its owners decide who computes what)."""

    def end_of_cycle(self) -> None:
        """Make the cycle's refresh results the ones in use."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


class TaskTimer:
    """Measures a method's tasks for the profiler on one rank; `method` names it (`Profile.method`)."""

    method = "kfac"

    def forward_context(self, op: Op) -> AbstractContextManager:
        """Context of the forwards of the profiler's last measured step (K-FAC captures there)."""
        return nullcontext()

    def before_optimizer_step(self) -> None:
        """The method's per-step work before the optimizer step, timed as part of the step end."""

    def measure(self, executor) -> dict[tuple[int, str], LayerMeasurement]:
        """(stage, layer) -> its task time samples in ms and capture sizes, for the stages this
        rank holds. Collective over the ranks (syncs are timed on the stages' groups)."""
        raise NotImplementedError
