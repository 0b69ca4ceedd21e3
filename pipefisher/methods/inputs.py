"""What a method's torch side is told about the run: `MethodInputs`, its own run-file section and
the few facts of the run it reads. The caller builds it from the run file
(`pipefisher.runtime.training.method_context`, `pipefisher.testing.method_inputs`), so no method
imports `pipefisher.config`. Pure Python."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pipefisher.methods.settings import RefreshConfig

S = TypeVar("S", bound=RefreshConfig)


@dataclass(frozen=True)
class MethodInputs(Generic[S]):
    """The run as a method's runtime, timer and reference see it."""

    #: the method's name (`optimizer.name`, its section's and flags' name)
    name: str
    #: its run-file section (`CurvatureMethod.settings`)
    settings: S
    #: the learning rate of the step it preconditions for (its section's `lr`, else `optimizer.lr`)
    lr: float
    #: `optimizer.betas` and `optimizer.eps` (Shampoo's Adam grafting reads them)
    betas: tuple[float, float]
    eps: float
    #: `run.precision`: fp32, bf16 or fp16 (fp16: `loss_scale()` gives the scale)
    precision: str
    #: micro-batches per step and pipeline, data-parallel replicas, sequences per micro-batch, tokens per sequence
    micro_batches: int
    data_parallel: int
    micro_batch_size: int
    seq_len: int
    #: gradient workers per layer (`pipefisher.planning.replicas.kaisa`); None: every replica of a stage
    workers_per_layer: int | None = None
    #: stage -> that stage's module built on the meta device (an ``nn.Module``), every stage of the
    #: model (given when the section's `helpers` is on: what a rank's buffers for the layers it
    #: helps on another rank's stage are shaped from)
    stage_modules: Mapping[int, Any] = field(default_factory=dict)

    @property
    def rows_per_step(self) -> int:
        """Rows (tokens) a step's gradient sums over, every micro-batch and replica."""
        return self.micro_batches * self.data_parallel * self.micro_batch_size * self.seq_len
