"""A run file's `MethodInputs`: what its curvature method's runtime, timer and reference are given
(the method's section and the run's facts; methods do not read `pipefisher.config`)."""

from __future__ import annotations

from typing import Any

import torch

from pipefisher.config import RunConfig
from pipefisher.methods.inputs import MethodInputs
from pipefisher.methods.registry import method_of
from pipefisher.models import StagedModel


def method_inputs(config: RunConfig, model: StagedModel | None = None) -> MethodInputs[Any]:
    """The inputs of `config`'s curvature method (`method_of`: on a first-order run, the method
    whose tasks its profile times, with that method's section); with the run's `model` and the
    section's `helpers` on, every stage's module built on the meta device."""
    name = method_of(config).name
    section = config.section(name)
    optimizer = config.optimizer_settings
    beta1, beta2 = config.optimizer.betas
    return MethodInputs(
        name=name,
        settings=section,
        lr=optimizer.lr,
        betas=(beta1, beta2),
        eps=config.optimizer.eps,
        precision=config.run.precision,
        micro_batches=config.pipeline.micro_batches,
        data_parallel=config.pipeline.data_parallel,
        micro_batch_size=config.data.micro_batch_size,
        seq_len=config.model.seq_len,
        workers_per_layer=config.workers_per_layer,
        stage_modules=_stage_modules(model, config) if model is not None and section.helpers else {},
    )


def _stage_modules(model: StagedModel, config: RunConfig) -> dict[int, torch.nn.Module]:
    """stage -> its module, every stage of `model`, built on the meta device (no storage)."""
    stages = config.model_chunks
    with torch.device("meta"):
        return {stage: model.build_stage(stage, stages, config.run.seed) for stage in range(stages)}
