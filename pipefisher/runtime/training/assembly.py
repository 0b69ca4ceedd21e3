"""Run assembly: the parts a run is made of, from its RunConfig: the schedule, the staged model,
the data source. `build_run(config)` is the entry point: it returns the run's `RunParts`, which
builds each part once, when first asked for, and holds it for whoever the run passes it to (the
executor builder, the curvature trainer, the reference, the profiler, the exporter); nothing is
cached per process. The functions below it build one part anew, for a caller that needs only it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

from pipefisher.config import ConfigError, RunConfig
from pipefisher.core.ir import Schedule
from pipefisher.data.synthetic import SyntheticRegression
from pipefisher.models import StagedModel
from pipefisher.models.registry import model_kind
from pipefisher.runtime.pipeline.batches import MicroBatchFn
from pipefisher.runtime.training import text_data as text
from pipefisher.schedules import chunks_per_rank, get_schedule
from pipefisher.schedules.validate import validate


class RunParts:
    """The parts of the run of `config`, each built at most once by this object, when first read.

    `on_data`: called once, before the run's text data is built (a model that reads text data
    builds it once its split is valid: `pipefisher run` says then that it prepares the data).
    """

    def __init__(self, config: RunConfig, on_data: Callable[[], None] | None = None) -> None:
        self.config = config
        self._on_data = on_data
        self._objective = ""

    def data_ready(self, objective: str = "") -> None:
        """Say (once) that the text data is about to be built; model builders call it when the
        model's split is valid, before they read `text_data`, with the `objective` the model
        trains ("bert" or "causal"), which `data.kind: shards` reads its folder for."""
        self._objective = objective or self._objective
        on_data, self._on_data = self._on_data, None
        if on_data is not None:
            on_data()

    @cached_property
    def schedule(self) -> Schedule:
        """The run's validated schedule (ScheduleError for an impossible one)."""
        return build_schedule(self.config)

    @cached_property
    def model(self) -> StagedModel:
        """The run's model behind the staged-model interface, built by its kind's builder
        (`pipefisher.models.registry`) and checked against the run's tensor-parallel degree and
        recompute mode (ConfigError naming the key)."""
        config = self.config
        model = model_kind(config.model.kind).build(self)
        degree = config.pipeline.tensor_parallel
        if degree > 1:
            try:
                model.tensor_parallel_plan(degree)
            except ValueError as exc:
                raise ConfigError(f"model.{exc}; or set pipeline.tensor_parallel 1") from None
        recompute_plan(model, config.model.recompute)
        return model

    @cached_property
    def text_data(self) -> Any:
        """The run's text data (`data.kind` bert, causal or shards: `pipefisher.runtime.training.text_data`)."""
        self.data_ready()
        config = self.config
        objective = self._objective or data_objective(config)
        step_micro_batches = config.pipeline.micro_batches * config.pipeline.data_parallel
        return text.text_data(config.data, config.model.seq_len, False, objective, step_micro_batches)

    @cached_property
    def data_source(self) -> MicroBatchFn:
        """(step, global micro-batch) -> batch, a pure function every rank can call."""
        if self.config.data.kind in ("bert", "causal", "shards"):
            return self.text_data.micro_batch
        return SyntheticRegression(self.config.data, self.config.model).micro_batch

    @property
    def recompute(self) -> tuple[str, ...]:
        """The module globs `model.recompute` checkpoints in the model's stages."""
        return recompute_plan(self.model, self.config.model.recompute)


def build_run(config: RunConfig, on_data: Callable[[], None] | None = None) -> RunParts:
    """The parts of the run of `config`, built as they are read (see `RunParts`)."""
    return RunParts(config, on_data)


def tokens_per_step(config: RunConfig) -> int:
    """The tokens (sequence positions) one training step of the run reads, over all replicas."""
    p = config.pipeline
    return p.micro_batches * p.data_parallel * config.data.micro_batch_size * config.model.seq_len


def data_objective(config: RunConfig) -> str:
    """What the run's model trains on its text: `data.kind` bert or causal, or for shards the
    model's objective (its kind's one text data kind; a Hugging Face model's from its class,
    read from a skeleton without weights). "" for synthetic data."""
    kind = config.data.kind
    if kind != "shards":
        return kind if kind in ("bert", "causal") else ""
    texts = [name for name in model_kind(config.model.kind).data if name in ("bert", "causal")]
    if len(texts) == 1:
        return texts[0]
    from pipefisher.runtime.training.hf_skeleton import hf_staged

    return hf_staged(config.model).layout.data


def build_schedule(config: RunConfig) -> Schedule:
    pipeline = config.pipeline
    chunks = chunks_per_rank(pipeline.schedule, pipeline.chunks)
    return validate(get_schedule(pipeline.schedule, pipeline.stages, pipeline.micro_batches, chunks))


def staged_model(config: RunConfig, on_data: Callable[[], None] | None = None) -> StagedModel:
    """The run's model, built anew (`RunParts.model`; a run reads it from its `RunParts`)."""
    return RunParts(config, on_data).model


def recompute_plan(model: StagedModel, mode: str) -> tuple[str, ...]:
    """The module globs `model.recompute` `mode` checkpoints in `model`'s stages; ConfigError
    naming the key when the model has nothing that mode recomputes."""
    try:
        return model.recompute_plan(mode)
    except ValueError as exc:
        raise ConfigError(f"model.{exc}") from None


def data_source(config: RunConfig) -> MicroBatchFn:
    """The run's data source, built anew (`RunParts.data_source`)."""
    return RunParts(config).data_source


def text_data(config: RunConfig) -> Any:
    """The run's text data, built anew (`RunParts.text_data`); each has `tokenizer`,
    `vocab_size` and `micro_batch` (tokenizer and tokens cached on disk)."""
    return RunParts(config).text_data


def held_out_batches(config: RunConfig, count: int) -> list[dict]:
    """`count` micro-batches of the text run's held-out documents (`data.holdout` > 0) or of its
    shards' valid split (`data.kind` shards), the same for every `data.seed`; ConfigError naming
    data.holdout otherwise (`text_data.held_out_batches`)."""
    return text.held_out_batches(config.data, config.model.seq_len, count, data_objective(config))
