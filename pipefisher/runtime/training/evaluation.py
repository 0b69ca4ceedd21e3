"""Held-out evaluation during a pipelined run (`run.eval_every`, `run.eval_batches`).

After every `run.eval_every` steps and after the last, every process runs the forward-only pass
of `pipefisher.runtime.pipeline.eval_pass` over the run's first `run.eval_batches` held-out
micro-batches (`pipefisher.runtime.training.assembly.held_out_batches`, the one place a data
source serves them) and the step's result gets `eval_loss`: their mean loss, as
`pipefisher.runtime.training.reference`'s evaluation computes it on the same parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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

    def due(self, done: int) -> bool:
        """Whether the run evaluates after `done` steps (1-based)."""
        return done % self.every == 0 or done == self.steps

    def after_step(self, result: StepResult) -> StepResult:
        """`result`, with `eval_loss` in its extra fields when the run evaluates after its step.
        Collective over every process: all call it after the same step."""
        if not self.due(result.step):
            return result
        evaluated = self.pass_.run()
        return dataclasses.replace(result, extra={**result.extra, "eval_loss": evaluated["loss"]})


def pipeline_evaluation(config: RunConfig, executor: Executor) -> PipelineEvaluation | None:
    """The run's evaluation on `executor`'s rank, or None with `run.eval_every` 0. Builds the
    held-out micro-batches (ConfigError naming the key when the data has none) and replays the
    pass's communication (CommOrderError, before any step)."""
    run = config.run
    if not run.eval_every:
        return None
    return PipelineEvaluation(run.eval_every, run.steps, EvalPass(executor, held_out_batches(config, run.eval_batches)))
