"""The generic reference twin of a `StageRuntime`: `StageReference`, one engine over the whole
model in one process, built as the runtime builds a stage's, with the pipeline's cycle semantics
(`ReferenceCurvature`). A method's reference subclasses it and writes the hooks only."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Generic

from torch import Tensor, nn

from pipefisher.methods.inputs import MethodInputs
from pipefisher.methods.interface import E, ReferenceCurvature
from pipefisher.methods.layers import first_order_linears, whole_model_globs


class StageReference(ReferenceCurvature, Generic[E]):
    """`self.engine`: `build_engine(inputs, modules, skip)` over the whole model (the same builder
    as the runtime's), `skip` the method's `MethodParts.skip` globs (`stage_skip`) made to match
    in the whole model (`whole_model_globs`). `capture` keeps the micro-batch's loss scale in
    `self.loss_scale` (fp16's, None otherwise) and, in a cycle's first step, runs inside
    `capture_context` (K-FAC's records; nothing by default)."""

    #: the method's `MethodParts.skip`: globs of a stage's names that stay first-order
    stage_skip: Callable[[Any], tuple[str, ...]] = staticmethod(first_order_linears)

    def __init__(self, config: MethodInputs[Any], model: Any, modules: nn.Module) -> None:
        super().__init__(config, model, modules)
        self.config = config
        self.loss_scale: Tensor | None = None
        self.engine: E = self.build_engine(config, modules, whole_model_globs(type(self).stage_skip(model)))

    def build_engine(self, config: MethodInputs[Any], module: nn.Module, skip: tuple[str, ...]) -> E:
        """The method's engine of `module` (the whole model), as the runtime's of a stage."""
        raise NotImplementedError

    def capture_context(self, micro_batch: int, loss_scale: Tensor | None) -> AbstractContextManager:
        """Context around a micro-batch's forward and backward in a cycle's first step."""
        return nullcontext()

    def capture(self, step: int, micro_batch: int, loss_scale: Tensor | None = None) -> AbstractContextManager:
        self.loss_scale = loss_scale
        return self.capture_context(micro_batch, loss_scale) if self.first_of_cycle(step) else nullcontext()
