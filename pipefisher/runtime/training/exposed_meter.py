"""The exposed optimizer time a run measures on its own steps (`pipefisher run`: `exposed_share`).

Definition: the run's plan (every step of its refresh cycle, all of the method's ops) and its
schedule alone (the first-order step of the same layout) are simulated on the op times this run
measured: each forward, backward, weight gradient, curvature, refresh and preconditioning op
takes the time of its kind, stage, layer and part over one recorded refresh cycle (each
process's median, averaged over the processes that ran it: replicas, tensor-parallel shards; in
the profile's time unit); collectives' transfers, stage-boundary transfers, gradient reductions
and the end of step take the run's profile's times. ``exposed_share = step_with / step_first_order - 1``, where step_with
is the simulated mean step over the cycle. The end of step is the profile's, in the first-order
step less the method's own work there (`StageProfile.method_step_end`: Shampoo's and SOAP's
preconditioning, which the profiler times; 0 in profiles measured before it was), as the
packer's figure. A plan with help ops is also simulated without them on the same times, its
precondition ops taking back their helped layers' measured help time
(`pipefisher.planning.packing.exposed.helpers_gain`): ``exposed_helpers_gain_ms``, negative where
the help ops cost the step more than they take off it (the trainer then packs without them).

Cost: the executor's clock marks every op of one refresh cycle only (perf_counter on CPUs, CUDA
events on GPUs: no host sync inside a step), the first full cycle after the run's first step
(warm-up), and again after a re-plan. At that cycle's end, after its last step's numbers were
read, the marks are read, the ranks' op times summed (one all-reduce, one host read) and both
steps simulated.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipefisher.core.ir import Op
from pipefisher.core.profile import Profile
from pipefisher.planning.packing.exposed import MeasuredDurations, TimingKey, exposed_time, helpers_gain, timing_key
from pipefisher.planning.plan import Plan
from pipefisher.planning.simulate import COLLECTIVES
from pipefisher.runtime.pipeline.executor import Executor
from pipefisher.runtime.pipeline.extension import ExecutorExtension
from pipefisher.runtime.primitives.clock import Mark


class _OpRecorder(ExecutorExtension):
    """The clock's marks around every op the rank runs while `records` is on."""

    def __init__(self) -> None:
        self.records = False
        self.marks: list[tuple[Op, Mark, Mark]] = []

    def record(self, op: Op, start: Mark, end: Mark) -> None:
        self.marks.append((op, start, end))


@dataclass(frozen=True)
class MeasuredExposed:
    """What a recorded cycle (steps `first_step`..`last_step`, 1-based) gave, in ms: the
    simulated mean step with the method (`step_ms`) and without (`first_order_ms`) on its op
    times, and the mean of its steps' measured wall times (`measured_step_ms`)."""

    first_step: int
    last_step: int
    step_ms: float
    first_order_ms: float
    measured_step_ms: float
    #: how much shorter the simulated step is with the plan's help ops than without (None: none)
    helpers_gain_ms: float | None = None

    @property
    def share(self) -> float:
        """step_ms / first_order_ms - 1 (the module's definition)."""
        return self.step_ms / self.first_order_ms - 1 if self.first_order_ms > 0 else 0.0

    def extra(self) -> dict[str, float | int | list[int]]:
        """The keys a step record carries (`pipefisher run --json`, metrics file)."""
        return {
            "exposed_share": self.share,
            "exposed_first_order_step_time_ms": self.first_order_ms,
            "exposed_step_time_ms": self.step_ms,
            "exposed_measured_step_time_ms": self.measured_step_ms,
            "exposed_steps": [self.first_step, self.last_step],
            **({} if self.helpers_gain_ms is None else {"exposed_helpers_gain_ms": self.helpers_gain_ms}),
        }


#: a profile time unit -> how many of it make a ms
_PER_MS = {"s": 1e-3, "ms": 1.0, "us": 1e3}


class ExposedMeter:
    """Measures `MeasuredExposed` (module docstring) on every rank. Call `before_step(step,
    cycle_step)` before every step and `after_step(...)` after it (collective at the end of a
    recorded cycle); `reset()` at a re-plan drops what the old plan recorded, so that the new
    plan's next full cycle is measured."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.recorder = _OpRecorder()
        executor.extend(self.recorder)
        self.result: MeasuredExposed | None = None
        self._first_seen: int | None = None
        self._walls: list[float] = []
        self._first_step = 0

    def reset(self) -> None:
        self.result, self._first_seen = None, None
        self.recorder.records, self.recorder.marks = False, []

    def before_step(self, step: int, cycle_step: int) -> None:
        """Start recording at a cycle's first step (0-based `step`) unless it is the first step
        this meter sees."""
        if self._first_seen is None:
            self._first_seen = step
        elif self.result is None and cycle_step == 0 and not self.recorder.records:
            self.recorder.records, self.recorder.marks, self._walls = True, [], []
            self._first_step = step + 1

    def after_step(self, seconds: float, plan: Plan, profile: Profile, cycle_end: bool) -> None:
        """After a step of `seconds` (wall) that ran `plan` (packed from `profile`); at the end of
        a recorded cycle (`cycle_end`) gather every rank's op times and simulate (collective)."""
        if not self.recorder.records:
            return
        self._walls.append(seconds)
        if not cycle_end:
            return
        self.recorder.records = False
        per_ms = _PER_MS.get(profile.time_unit, 1.0)
        medians = self._gathered_medians(plan, per_ms)
        self.recorder.marks = []
        durations = MeasuredDurations(profile, medians, plan.schedule.splits_backward)
        exposed = exposed_time(plan, durations)
        self.result = MeasuredExposed(
            self._first_step,
            self._first_step + len(self._walls) - 1,
            exposed.step_time / per_ms,
            exposed.first_order_step_time / per_ms,
            1000 * sum(self._walls) / len(self._walls),
            helpers_gain(plan, durations) / per_ms if plan.helped else None,
        )

    def _gathered_medians(self, plan: Plan, per_ms: float) -> dict[TimingKey, list[float]]:
        """Every op kind's time (`timing_key`) in the profile's unit: this process's median of its
        recorded samples, averaged over the processes that ran it. One all-reduce of a vector laid
        out by the plan's ops (the same on every rank) and one host read."""
        timed = {timing_key(op) for step in plan.steps for ranks in step for op in ranks if op.kind not in COLLECTIVES}
        keys = sorted(timed, key=lambda key: (key[0].value, key[1], key[2] or "", key[3] or 0))
        samples: dict[TimingKey, list[float]] = defaultdict(list)
        clock = self.executor.clock
        for op, start, end in self.recorder.marks:
            samples[timing_key(op)].append(per_ms * clock.elapsed_ms(start, end))
        local = [statistics.median(samples[key]) if samples.get(key) else 0.0 for key in keys]
        counts = [1.0 if samples.get(key) else 0.0 for key in keys]
        totals = torch.tensor(local + counts, dtype=torch.float64, device=self.executor.device)
        dist.all_reduce(totals)
        summed = totals.tolist()
        return {key: [summed[i] / summed[len(keys) + i]] for i, key in enumerate(keys) if summed[len(keys) + i] > 0}
