"""Models cut into pipeline stages, behind one interface the runtime and the reference use. The
kinds of model a run file names are declared in `pipefisher.models.registry`. Importing this
package does not import torch (the registry is read by torch-free configuration and planning)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pipefisher.core.tensor_parallel import TensorParallelPlan

if TYPE_CHECKING:
    from torch import Tensor, nn

#: one micro-batch: named tensors (inputs, targets, masks, labels) of the data source, read only
Batch = Mapping[str, "Tensor"]


class StagedModel(Protocol):
    """A model the pipeline can cut into `num_stages` stages.

    A stage's `forward(x, batch)` takes the previous stage's activation (None on stage 0) and the
    micro-batch. Parameter names are global and each parameter depends on (seed, its name) alone,
    so every rank, the reference and any split build the same parameters: the union of all stages'
    parameters is the one-stage model's (`pipefisher.models.init.build_initialised`).
    """

    #: names of the parts `loss` returns (reported per step)
    loss_parts: tuple[str, ...]

    def build_stage(self, index: int, num_stages: int, seed: int) -> nn.Module: ...

    def activation_shape(self, stage: int, num_stages: int, micro_batch_size: int) -> tuple[int, ...]:
        """Shape of what `stage` sends to `stage + 1`."""

    def loss(self, output: Any, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss of one micro-batch, named parts) from the last stage's output (what the model's
        last stage returns)."""

    def tied_parameters(self) -> list[tuple[str, str]]:
        """Parameters held by two stages as copies of one weight: ("first"|"last", name in stage)."""

    def first_order_linears(self) -> tuple[str, ...]:
        """Glob patterns of Linear layers that stay first-order."""

    def tensor_parallel_plan(self, degree: int) -> TensorParallelPlan:
        """Which Linear layers `degree` tensor-parallel processes split, and how
        (`pipefisher.core.tensor_parallel`); ValueError naming the model field `degree` does not
        divide, or when the model cannot be split."""

    def recompute_plan(self, mode: str) -> tuple[str, ...]:
        """Globs of the modules `model.recompute` `mode` (none, selective, blocks) checkpoints
        (`pipefisher.runtime.primitives.recompute`); ValueError naming the key when the model has
        nothing that mode could recompute."""
