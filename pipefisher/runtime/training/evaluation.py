"""Held-out evaluation during a pipelined run (`run.eval_every`, `run.eval_batches`).

After every `run.eval_every` steps and after the last, every process runs the forward-only pass
of `pipefisher.runtime.pipeline.eval_pass` over the run's first `run.eval_batches` held-out
micro-batches (`pipefisher.runtime.training.assembly.held_out_batches`, the one place a data
source serves them) and the step's result gets `eval_loss`: their mean loss, as
`pipefisher.runtime.training.reference`'s evaluation computes it on the same parameters, and
`eval_<part>` for each named part of the loss (BERT's `eval_mlm`, `eval_nsp`).

`TrainingClock` gives every step record `train_s`: wall seconds since the first step began, less
the time held-out evaluation took, on the reporting process's clock (no device synchronisation of
its own: a step's end is where the step itself waits).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from pipefisher.config import RunConfig
from pipefisher.runtime.pipeline.eval_pass import EvalPass
from pipefisher.runtime.pipeline.executor import Executor, StepResult
from pipefisher.runtime.training.assembly import held_out_batches


@dataclass(frozen=True)
class PipelineEvaluation:
    """Evaluation after every `every` steps and after step `steps` (the run's last), by `pass_`."""

    every: int
    steps: int
    pass_: EvalPass

    def due(self, done: int, last: bool = False) -> bool:
        """Whether the run evaluates after `done` steps (1-based); `last`: the run ends there."""
        return last or done % self.every == 0 or done == self.steps

    def after_step(self, result: StepResult, last: bool = False) -> StepResult:
        """`result`, with `eval_loss` in its extra fields when the run evaluates after its step
        (`last`: the run's last, short of `steps`). Collective over every process: all call it
        after the same step."""
        if not self.due(result.step, last):
            return result
        return dataclasses.replace(result, extra={**result.extra, **eval_fields(self.pass_.run())})


def eval_fields(evaluated: Mapping[str, float]) -> dict[str, float]:
    """A step record's held-out fields: `eval_loss` (the mean loss) and `eval_<part>` per named part."""
    return {("eval_loss" if name == "loss" else f"eval_{name}"): value for name, value in evaluated.items()}


@dataclass
class TrainingClock:
    """Wall seconds of training: since the clock was made, less the spans spent in `paused()`."""

    start: float = field(default_factory=time.perf_counter)
    paused_s: float = 0.0

    def seconds(self) -> float:
        """Training seconds so far."""
        return time.perf_counter() - self.start - self.paused_s

    @contextmanager
    def paused(self) -> Iterator[None]:
        """A span (held-out evaluation) that does not count as training."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - began

    def deadline(self, budget_s: float) -> float | None:
        """The `time.perf_counter()` reading at which `budget_s` training seconds will have passed
        if nothing more is paused (None for 0: no budget)."""
        return self.start + self.paused_s + budget_s if budget_s else None

    def spent(self, budget_s: float) -> bool:
        """Whether `budget_s` training seconds have passed (never for 0: no budget)."""
        return bool(budget_s) and self.seconds() >= budget_s

    def stamped(self, result: StepResult) -> StepResult:
        """`result` with `train_s` in its extra fields."""
        return dataclasses.replace(result, extra={**result.extra, "train_s": self.seconds()})


def pipeline_evaluation(config: RunConfig, executor: Executor) -> PipelineEvaluation | None:
    """The run's evaluation on `executor`'s rank, or None with `run.eval_every` 0. Builds the
    held-out micro-batches (ConfigError naming the key when the data has none) and replays the
    pass's communication (CommOrderError, before any step)."""
    run = config.run
    if not run.eval_every:
        return None
    return PipelineEvaluation(run.eval_every, run.steps, EvalPass(executor, held_out_batches(config, run.eval_batches)))
