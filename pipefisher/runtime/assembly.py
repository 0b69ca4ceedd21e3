"""Run assembly: the parts a run is made of, from its RunConfig: the schedule, the staged model,
the data source. The pipelined executor, the single-process reference, the profiler and the
K-FAC trainer all take their parts from here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from pipefisher.config import ConfigError, DataConfig, RunConfig, split_hint
from pipefisher.data.synthetic import SyntheticRegression
from pipefisher.ir import Schedule
from pipefisher.models import StagedModel
from pipefisher.models.tiny import TinyRegression
from pipefisher.runtime.errors import first_line
from pipefisher.runtime.executor import MicroBatchFn
from pipefisher.schedules import get_schedule
from pipefisher.validate import validate


def build_schedule(config: RunConfig) -> Schedule:
    pipeline = config.pipeline
    chunks = pipeline.chunks if pipeline.schedule == "interleaved" else None
    return validate(get_schedule(pipeline.schedule, pipeline.stages, pipeline.micro_batches, chunks))


def staged_model(config: RunConfig, on_data: Callable[[], None] | None = None) -> StagedModel:
    """The model of the run behind the staged-model interface (ConfigError if it cannot be split
    into the run's stages); BERT calls `on_data()` once the split is valid, before it builds (or
    loads from the cache) the tokenizer and tokens."""
    if config.model.kind != "bert":
        return TinyRegression(config.model)
    from pipefisher.models.bert import BertConfig, BertStagedModel, bert_preset

    settings = config.model
    try:
        bert = BertConfig.from_json(settings.config_json) if settings.config_json else bert_preset(settings.preset)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"model: {first_line(exc)}") from None
    if bert.num_hidden_layers % config.model_chunks:
        raise ConfigError(
            f"model: {bert.num_hidden_layers} BERT layers cannot be split into {config.model_chunks} equal stages; "
            + split_hint(bert.num_hidden_layers, "pipeline.stages x pipeline.chunks" if config.pipeline.schedule == "interleaved" else "pipeline.stages")
        )
    if settings.seq_len > bert.max_position_embeddings:
        raise ConfigError(f"model.seq_len: {settings.seq_len} exceeds the model's {bert.max_position_embeddings} positions")
    if on_data is not None:
        on_data()
    bert = dataclasses.replace(bert, vocab_size=pretraining_data(config).vocab_size)
    if settings.dropout >= 0:
        bert = dataclasses.replace(bert, hidden_dropout_prob=settings.dropout, attention_probs_dropout_prob=settings.dropout)
    return BertStagedModel(bert, settings.seq_len)


@functools.cache
def _pretraining_data(data: DataConfig, seq_len: int):
    from pipefisher.data.corpus import embedded_corpus, read_corpus
    from pipefisher.data.pretraining import PretrainingData, default_cache_dir
    from pipefisher.data.tokenizer import load_vocab, train_wordpiece

    cache = data.cache_dir or str(default_cache_dir())
    documents = embedded_corpus() if data.corpus == "embedded" else read_corpus(data.corpus)
    tokenizer = load_vocab(data.vocab) if data.vocab else train_wordpiece(documents, data.vocab_size, cache)
    return PretrainingData(documents, tokenizer, seq_len, data.micro_batch_size, data.seed, data.mask_prob, cache)


def pretraining_data(config: RunConfig):
    """The BERT pretraining data of the run (built once per process; tokenizer and tokens cached on disk)."""
    return _pretraining_data(config.data, config.model.seq_len)


def data_source(config: RunConfig) -> MicroBatchFn:
    """(step, global micro-batch) -> batch, a pure function every rank can call."""
    if config.data.kind == "bert":
        return pretraining_data(config).micro_batch
    return SyntheticRegression(config.data, config.model).micro_batch
