"""The executor: one rank performs its actions of a step (`pipefisher.planning.comm.plan`) in order.

RUN dispatches an op to its handler (forward, backward, K-FAC ops); POST, SEND, LAUNCH and WAIT
are the communication the plan derived and the replay checked, nothing more and in that order.
A handler takes its op's input from what a WAIT received (or from the op that produced it on
this rank) and leaves its output for the SEND that follows; the executor then keeps the tensor
only in the send's handle (`_sends`), which the plan's WAIT for the send drops, soon after the
send (`pipefisher.planning.comm.send_waits`). After the actions, the next step's
micro-batches are built (`Executor.steps`) and the step end (`StepEnd.finish`) applies the
gradients and reads the step's numbers. Under bf16/fp16 the low-precision copies of the weights
live from a step's first forward to its optimizer step (`Precision.step_casts`): each weight is cast
once per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.profiler import record_function

from pipefisher.core.ir import Op, OpKind, ScheduleError, splits_backward
from pipefisher.core.op_fields import micro_batch_of
from pipefisher.core.topology import Topology
from pipefisher.core.trace_labels import PREPARE, step_label, step_time_label
from pipefisher.planning.comm.actions import (
    Action,
    ActionKind,
    Collective,
    CollectiveKind,
    GradientPath,
    Message,
    SendDone,
    input_message,
    output_message,
)
from pipefisher.runtime.errors import first_line
from pipefisher.runtime.gradient_path.step_end import StepEnd
from pipefisher.runtime.primitives.clock import Clock
from pipefisher.runtime.primitives.comm import Comm, Handle, done
from pipefisher.runtime.pipeline.batches import DeviceBatch, MicroBatchFn, prepare
from pipefisher.runtime.pipeline.extension import ExecutorExtension, Extensions
from pipefisher.runtime.pipeline.stage import StageRuntime

#: message -> (shape, dtype) of the tensor it carries
MessageSpec = Callable[[Message], tuple[tuple[int, ...], torch.dtype]]


#: what an unlabelled action runs under (no profiler on: labels would cost without showing)
UNLABELLED = nullcontext()


class StepFailure(RuntimeError):
    """An op failed; the message names the rank, the step and the op."""


@dataclass(frozen=True)
class StepResult:
    """One finished step: 1-based `step`, mean loss, wall time; `extra` fields to log."""

    step: int
    loss: float
    seconds: float
    extra: dict = field(default_factory=dict)


def describe(action: Action) -> str:
    """The op (or collective) an action belongs to, for error messages."""
    kind, target = action.kind, action.target
    if kind is ActionKind.RUN:
        return f"op {target}"
    if isinstance(target, SendDone):
        return f"op {target.message.producer} (waiting for the send of its output)"
    if isinstance(target, Message):
        what = {
            ActionKind.POST: "posting the receive of its input",
            ActionKind.SEND: "sending its output",
            ActionKind.WAIT: "waiting for its input",
        }[kind]
        return f"op {target.producer if kind is ActionKind.SEND else target.consumer} ({what})"
    return f"collective {target}" + (" (waiting)" if kind is ActionKind.WAIT else "")


class Executor:
    def __init__(
        self,
        topology: Topology,
        rank: int,
        stages: dict[tuple[int, int], StageRuntime],
        comm: Comm,
        micro_batch: MicroBatchFn,
        message_spec: MessageSpec,
        step_end: StepEnd,
        device: torch.device,
        tied: bool = False,
        gradient_path: GradientPath = GradientPath(),
        extensions: Extensions | None = None,
        recompute: str = "none",
    ):
        """`tied`: the model's tied weights live on several stages (the end of step sums them);
        `gradient_path`: ZeRO-1 or PowerSGD at the end of the step (`pipefisher.planning.comm.plan`);
        `extensions`: where the extensions `extend` adds go, the one `step_end` was built with
        (its `before_optimizer_step` runs theirs); `recompute`: the `model.recompute` its stages
        were built with (what their backwards all-reduce, `pipefisher.planning.comm.processes`)."""
        self.topology, self.rank, self.stages, self.comm = topology, rank, stages, comm
        self.tied, self.gradient_path, self.recompute = tied, gradient_path, recompute
        self.micro_batch, self.message_spec, self.step_end = micro_batch, message_spec, step_end
        self.device = device
        self.replica = topology.replica_of(rank)
        #: op kind -> its handler: the executor's own, then its extensions'
        self.handlers: dict[OpKind, Callable[[Op], None]] = {
            OpKind.FORWARD: self._forward,
            OpKind.BACKWARD: self._backward,
            OpKind.WEIGHT: self._weight,
        }
        if splits_backward(topology.schedule.ranks[topology.pipeline_rank(rank)]):
            for stage in stages.values():
                stage.split_backward()
        #: collective kind -> what launches one: the step end's, then the extensions'
        self.collectives: dict[CollectiveKind, Callable[[Collective], Handle]] = {
            CollectiveKind.GRAD: step_end.launch_grad,
            CollectiveKind.TIED: step_end.launch_tied,
            CollectiveKind.STEP: step_end.launch_step,
            CollectiveKind.GATHER: step_end.launch_gather,
            CollectiveKind.GRAD_Q: step_end.launch_grad_q,
            CollectiveKind.UNSHARD: step_end.launch_unshard,
            CollectiveKind.GRAD_PIPES: step_end.launch_grad_pipes,
        }
        #: the extensions whose hooks run (forward context, after backward, before the optimizer step, record)
        self._extensions = extensions if extensions is not None else Extensions()
        self.clock = Clock(device)
        self.current_step = 0
        #: (step, global micro-batch) -> that micro-batch, built once per step on this rank
        self._batches: dict[tuple[int, int], DeviceBatch] = {}
        #: the next step's micro-batches, prepared at the end of this one (`steps`)
        self._ahead: dict[tuple[int, int], DeviceBatch] = {}
        #: the run's steps: during step s < steps - 1, step s + 1's micro-batches are prepared
        #: once this rank's ops of step s are issued; None: each is built at its first forward
        self.steps: int | None = None
        #: all stages of a rank compute in one precision; its weight casts live for a step
        self.precision = next(iter(stages.values())).precision
        self._casts = ExitStack()
        self._receives: dict[Message, tuple[Tensor, Handle]] = {}
        self._inputs: dict[Message, Tensor] = {}
        self._outputs: dict[Message, Tensor] = {}
        self._sends: dict[Message, Handle] = {}
        #: collectives in flight (K-FAC syncs and exchanges may outlive a step)
        self.in_flight: dict[Collective, Handle] = {}

    # -- extension points -------------------------------------------------------------------
    def extend(self, extension: ExecutorExtension) -> None:
        """Add `extension`: its handlers and collective launchers, and its hooks after those there are."""
        self.handlers.update(extension.handlers())
        self.collectives.update(extension.collectives())
        self.extensions += (extension,)

    @contextmanager
    def hooks_of(self, *extensions: ExecutorExtension) -> Iterator[None]:
        """Only the hooks of `extensions` run while the context lasts (the profiler measures
        steps without the run's curvature method capturing anything); handlers stay."""
        saved, self.extensions = self.extensions, extensions
        try:
            yield
        finally:
            self.extensions = saved

    def _forward_context(self, op: Op) -> AbstractContextManager:
        if len(self.extensions) == 1:
            return self.extensions[0].forward_context(op)
        stack = ExitStack()
        for extension in self.extensions:
            stack.enter_context(extension.forward_context(op))
        return stack

    @property
    def extensions(self) -> tuple[ExecutorExtension, ...]:
        """The extensions whose hooks run (forward context, after backward, before the optimizer step, record)."""
        return self._extensions.active

    @extensions.setter
    def extensions(self, extensions: tuple[ExecutorExtension, ...]) -> None:
        self._extensions.active = extensions

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.step_end.optimizer

    @property
    def scheduler(self):
        return self.step_end.scheduler

    # -- a step ------------------------------------------------------------------------------
    def run_step(self, step: int, actions: Sequence[Action], update: bool = True) -> StepResult:
        """Perform `actions` as step `step` (0-based); with `update=False` gradients are dropped
        instead of applied (profiling steps leave the model as it was). Under a profiler the step is
        the region ``step N`` and a marker after it carries the result's `seconds`
        (`pipefisher.core.trace_labels`), so a trace gives the step time `pipefisher run` prints."""
        self.current_step = step
        self._batches = {key: batch for key, batch in self._ahead.items() if key[0] == step}
        self._ahead = {}
        self.step_end.begin(step, update)
        labelled = torch.autograd._profiler_enabled()  # torch.profiler, or NVTX ranges under emit_nvtx
        start = time.perf_counter()
        with record_function(step_label(step + 1)) if labelled else UNLABELLED:
            # each weight cast once per step: until the optimizer step (`_perform`) or the actions' end
            with self._casts:
                self._casts.enter_context(self.precision.step_casts())
                for action in actions:
                    try:
                        with record_function(str(action)) if labelled else UNLABELLED:
                            self._perform(action)
                    except Exception as exc:
                        raise StepFailure(
                            f"rank {self.rank} failed at step {step + 1}, {describe(action)}: {first_line(exc)}"
                        ) from exc
            if self.steps is not None and step + 1 < self.steps:
                with record_function(PREPARE) if labelled else UNLABELLED:
                    self._prepare(step + 1)
            pending = [f"{pipe}.{stage}" for (pipe, stage), runtime in self.stages.items() if runtime.pending_weights]
            if pending:  # a plan runs every W of a step within it; the gradients would be incomplete
                raise StepFailure(
                    f"rank {self.rank} failed at step {step + 1}: weight gradients of stage(s) {', '.join(pending)} still pending at its end"
                )
            try:
                with record_function("step end") if labelled else UNLABELLED:
                    record = self.step_end.finish()
            except Exception as exc:
                raise StepFailure(
                    f"rank {self.rank} failed at step {step + 1}, end of step: {first_line(exc)}"
                ) from exc
        seconds = time.perf_counter() - start
        if labelled:
            with record_function(step_time_label(step + 1, 1000 * seconds)):
                pass
        loss = record.pop("loss")
        return StepResult(step=step + 1, loss=loss, seconds=seconds, extra=record)

    def _perform(self, action: Action) -> None:
        kind, target = action.kind, action.target
        if kind is ActionKind.RUN:
            op = action.op
            recording = [extension for extension in self.extensions if extension.records]
            if not recording:
                self.handlers[op.kind](op)
                return
            started = self.clock.mark()
            self.handlers[op.kind](op)
            ended = self.clock.mark()
            for extension in recording:
                extension.record(op, started, ended)
        elif kind is ActionKind.POST:
            message, (group, peer) = action.message, action.link
            shape, dtype = self.message_spec(message)
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            self._receives[message] = (buffer, self.comm.recv(buffer, peer, group))
        elif kind is ActionKind.SEND:
            message, (group, peer) = action.message, action.link
            self._sends[message] = self.comm.send(self._outputs.pop(message), peer, group)
        elif kind is ActionKind.LAUNCH:
            collective = action.collective
            self.in_flight[collective] = self.collectives[collective.kind](collective)
        elif isinstance(target, Message):
            buffer, handle = self._receives.pop(target)
            handle.wait()
            self._inputs[target] = buffer
        elif isinstance(target, SendDone):
            self._sends.pop(target.message).wait()
        else:
            collective = action.collective
            if collective.kind is CollectiveKind.STEP:  # its completion steps the optimizer: casts go stale
                self._casts.close()
            self.in_flight.pop(collective).wait()

    def settle(self, complete: Sequence[Collective], relaunch: Sequence[Collective]) -> None:
        """Between steps (checkpoints, resumption): wait for the collectives in `complete` (every
        member has launched them), keeping them as done; launch `relaunch` afresh (this rank's part
        of collectives launched before a resumption whose peers launch them later)."""
        for collective in complete:
            self.in_flight.setdefault(collective, done()).wait()
        for collective in relaunch:
            self.in_flight[collective] = self.collectives[collective.kind](collective)

    def _prepare(self, step: int) -> None:
        """Build step `step`'s micro-batches now, those this step's forwards read, and start
        moving the names they read to the device (the data source is pure: the same batches as
        built at their first forward, so a resumed run sees the same)."""
        names = {name for batch in self._batches.values() for name in batch.moved}
        indices = sorted(index for _, index in self._batches)
        self._ahead = prepare(self.micro_batch, step, indices, names, self.device)

    # -- handlers ----------------------------------------------------------------------------
    def _forward(self, op: Op) -> None:
        stage = self.stages[(op.pipe, op.stage)]
        micro_batch = micro_batch_of(op)
        key = (self.current_step, self.topology.global_micro_batch(self.rank, micro_batch))
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = DeviceBatch(self.micro_batch(*key), self.device)
        inputs = None if stage.first else self._input_of(op)
        with self._forward_context(op):
            output = stage.forward(micro_batch, inputs, batch)
        self._output_of(op, output)

    def _backward(self, op: Op) -> None:
        stage = self.stages[(op.pipe, op.stage)]
        grad_output = None if stage.last else self._input_of(op)
        self._output_of(op, stage.backward(micro_batch_of(op), grad_output))
        for extension in self.extensions:
            extension.after_backward(op)

    def _weight(self, op: Op) -> None:
        self.stages[(op.pipe, op.stage)].weight(micro_batch_of(op))
        for extension in self.extensions:
            extension.after_backward(op)

    def _input_of(self, op: Op) -> Tensor:
        message = input_message(op, self.topology.schedule.num_stages)
        if message is None:
            raise ScheduleError(f"{op} reads no message from another stage")
        if message in self._inputs:
            return self._inputs.pop(message)
        return self._outputs.pop(message)  # produced on this rank

    def _output_of(self, op: Op, tensor: Tensor | None) -> None:
        message = output_message(op, self.topology.schedule.num_stages)
        if message is not None:
            if tensor is None:
                raise ScheduleError(f"{op} produced nothing for {message}")
            self._outputs[message] = tensor
