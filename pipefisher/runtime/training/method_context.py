"""A run file's `MethodInputs`: what its curvature method's runtime, timer and reference are given
(the method's section and the run's facts; methods do not read `pipefisher.config`)."""

from __future__ import annotations

from typing import Any

from pipefisher.config import RunConfig
from pipefisher.methods.inputs import MethodInputs
from pipefisher.methods.registry import method_of


def method_inputs(config: RunConfig) -> MethodInputs[Any]:
    """The inputs of `config`'s curvature method (`method_of`: on a first-order run, the method
    whose tasks its profile times, with that method's section)."""
    name = method_of(config).name
    optimizer = config.optimizer_settings
    beta1, beta2 = config.optimizer.betas
    return MethodInputs(
        name=name,
        settings=config.section(name),
        lr=optimizer.lr,
        betas=(beta1, beta2),
        eps=config.optimizer.eps,
        precision=config.run.precision,
        micro_batches=config.pipeline.micro_batches,
        data_parallel=config.pipeline.data_parallel,
        micro_batch_size=config.data.micro_batch_size,
        seq_len=config.model.seq_len,
        workers_per_layer=config.workers_per_layer,
    )
