"""The executor's named extension points: what a part of a run (a curvature method, the profiler,
a test's fault) adds to the executor, given to it through `Executor.extend` instead of assigned
into it. Every point is optional; the executor calls the points of its extensions in the order
they were added."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext

from pipefisher.core.ir import Op, OpKind
from pipefisher.planning.comm.actions import Collective, CollectiveKind
from pipefisher.runtime.primitives.comm import Handle
from pipefisher.runtime.primitives.clock import Mark


class ExecutorExtension:
    """A part of a run the executor calls at its named points."""

    #: whether `record` wants the device clock's marks around every op (they cost a little)
    records: bool = False

    def handlers(self) -> Mapping[OpKind, Callable[[Op], None]]:
        """Handlers of the op kinds it runs (replacing the executor's own for those kinds)."""
        return {}

    def collectives(self) -> Mapping[CollectiveKind, Callable[[Collective], Handle]]:
        """Launchers of the collective kinds it starts."""
        return {}

    def forward_context(self, op: Op) -> AbstractContextManager:
        """The context the forward of `op` runs in."""
        return nullcontext()

    def after_backward(self, op: Op) -> None:
        """Called after every backward and weight-gradient op."""

    def before_optimizer_step(self) -> None:
        """Called on the reduced, clipped gradients right before the optimizer step (not when
        fp16 overflowed)."""

    def record(self, op: Op, start: Mark, end: Mark) -> None:
        """Called with the clock's marks around every op run, when `records` is set."""


class Extensions:
    """The extensions whose hooks run, in the order they were added: shared by the executor (which
    adds them and calls most hooks) and the step end (which calls `before_optimizer_step`, given
    it at construction), so that neither patches the other."""

    def __init__(self) -> None:
        self.active: tuple[ExecutorExtension, ...] = ()

    def before_optimizer_step(self) -> None:
        for extension in self.active:
            extension.before_optimizer_step()
