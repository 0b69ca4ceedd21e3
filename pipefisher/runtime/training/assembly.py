"""Run assembly: the parts a run is made of, from its RunConfig: the schedule, the staged model,
the data source. The pipelined executor, the single-process reference, the profiler and the
K-FAC trainer all take their parts from here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

from pipefisher.config import ConfigError, DataConfig, ModelConfig, RunConfig, split_hint, stage_count_terms
from pipefisher.core.ir import Schedule
from pipefisher.data.synthetic import SyntheticRegression
from pipefisher.models import StagedModel
from pipefisher.models.registry import model_kind
from pipefisher.models.tiny import TinyRegression
from pipefisher.runtime.errors import first_line
from pipefisher.runtime.pipeline.executor import MicroBatchFn
from pipefisher.schedules import chunks_per_rank, get_schedule
from pipefisher.schedules.validate import validate


def build_schedule(config: RunConfig) -> Schedule:
    pipeline = config.pipeline
    chunks = chunks_per_rank(pipeline.schedule, pipeline.chunks)
    return validate(get_schedule(pipeline.schedule, pipeline.stages, pipeline.micro_batches, chunks))


def staged_model(config: RunConfig, on_data: Callable[[], None] | None = None) -> StagedModel:
    """The model of the run behind the staged-model interface, built by its kind's builder
    (`pipefisher.models.registry`; ConfigError if it cannot be split into the run's stages and
    tensor-parallel shards); BERT and Hugging Face models call `on_data()` once the split is valid,
    before they build (or load from the cache) the tokenizer and tokens."""
    model = model_kind(config.model.kind).build(config, on_data)
    degree = config.pipeline.tensor_parallel
    if degree > 1:
        try:
            model.tensor_parallel_plan(degree)
        except ValueError as exc:
            raise ConfigError(f"model.{exc}; or set pipeline.tensor_parallel 1") from None
    recompute_plan(model, config.model.recompute)
    return model


def recompute_plan(model: StagedModel, mode: str) -> tuple[str, ...]:
    """The module globs `model.recompute` `mode` checkpoints in `model`'s stages; ConfigError
    naming the key when the model has nothing that mode recomputes."""
    try:
        return model.recompute_plan(mode)
    except ValueError as exc:
        raise ConfigError(f"model.{exc}") from None


def regression_model(config: RunConfig, on_data: Callable[[], None] | None = None) -> StagedModel:
    """The builder of model.kind transformer and mlp: the regression model (its data is synthetic,
    built by `data_source`; `on_data` is not called)."""
    return TinyRegression(config.model)


def bert_model(config: RunConfig, on_data: Callable[[], None] | None = None) -> StagedModel:
    """The builder of model.kind bert: a preset or `model.config_json`, split-checked, with the
    vocabulary of the run's pretraining data."""
    from pipefisher.models.bert import BertConfig, BertStagedModel, bert_preset

    settings = config.model
    try:
        bert = BertConfig.from_json(settings.config_json) if settings.config_json else bert_preset(settings.preset)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"model: {first_line(exc)}") from None
    if bert.num_hidden_layers % config.model_chunks:
        raise _unsplittable(config, f"{bert.num_hidden_layers} BERT layers", bert.num_hidden_layers)
    if settings.seq_len > bert.max_position_embeddings:
        raise ConfigError(
            f"model.seq_len: {settings.seq_len} exceeds the model's {bert.max_position_embeddings} positions"
        )
    if on_data is not None:
        on_data()
    bert = dataclasses.replace(bert, vocab_size=pretraining_data(config).vocab_size)
    if settings.dropout >= 0:
        bert = dataclasses.replace(
            bert, hidden_dropout_prob=settings.dropout, attention_probs_dropout_prob=settings.dropout
        )
    return BertStagedModel(bert, settings.seq_len)


def _unsplittable(config: RunConfig, what: str, count: int) -> ConfigError:
    """The error for a model of `count` layers/blocks (`what`) the run's stages do not divide."""
    _, product = stage_count_terms(config.pipeline)
    return ConfigError(
        f"model: {what} cannot be split into {config.model_chunks} equal stages; {split_hint(count, product)}"
    )


def hf_model(config: RunConfig, on_data: Callable[[], None] | None = None) -> StagedModel:
    """The builder of model.kind hf, the run's Hugging Face model: its config with the run's dropout, vocabulary and special
    ids, checked against the run's stages and data before the data is built."""
    settings = config.model
    model = _hf_staged(settings)
    if model.num_blocks % config.model_chunks:
        raise _unsplittable(config, f"{model.num_blocks} blocks of {model.layout.blocks}", model.num_blocks)
    try:
        model.check_split(config.model_chunks)
    except ValueError as exc:
        raise ConfigError(f"model.{exc}") from None
    recompute_plan(model, settings.recompute)  # refused before the data is built
    if model.layout.data != config.data.kind:
        raise ConfigError(
            f"data.kind: {config.data.kind!r} does not fit {model.cls.__name__}; it needs data.kind {model.layout.data}"
        )
    if on_data is not None:
        on_data()
    try:
        data = text_data(config)
    except (ValueError, OSError) as exc:
        message = str(exc).splitlines()[0]
        raise ConfigError(
            f"data.{message}" if message.startswith(("tokenizer:", "holdout:")) else f"data: {message}"
        ) from None
    if settings.hf_weights:
        if data.vocab_size > model.config.vocab_size:
            raise ConfigError(
                f"data: the tokenizer has {data.vocab_size} tokens, more than the {model.config.vocab_size} of "
                "model.hf_weights; give data.tokenizer the checkpoint's tokenizer.json"
            )
        return model
    special = (
        {"pad_token_id": data.special.pad}
        if config.data.kind == "bert"
        else {"bos_token_id": data.end_of_text, "eos_token_id": data.end_of_text, "pad_token_id": None}
    )
    return _hf_staged(settings, (("vocab_size", data.vocab_size), *special.items()))


@functools.cache
def _hf_staged(settings: ModelConfig, overrides: tuple[tuple[str, object], ...] = ()):
    """The Hugging Face staged model of `settings` with `overrides` of its config, built once per
    process (building the skeleton of a large model takes seconds); ConfigError naming the key."""
    try:
        from pipefisher.models.hf import DROPOUT_FIELDS, HfStagedModel, load_hf_config
    except ImportError:
        raise ConfigError('model.kind hf needs Hugging Face transformers: pip install -e ".[hf]"') from None
    try:
        hf_config = load_hf_config(settings.hf_config, **dict(overrides))
        if settings.dropout >= 0:
            for name in DROPOUT_FIELDS:
                if hasattr(hf_config, name):
                    setattr(hf_config, name, settings.dropout)
        class_name = settings.hf_class or (getattr(hf_config, "architectures", None) or [""])[0]
        if not class_name:
            raise ValueError("hf_class: the config names no architectures; set model.hf_class (e.g. GPT2LMHeadModel)")
        return HfStagedModel(class_name, hf_config, settings.seq_len, settings.hf_weights)
    except ValueError as exc:
        # every message names its field (hf_config, hf_class, hf_weights, seq_len)
        raise ConfigError(f"model.{exc}") from None


def _documents(data: DataConfig, held_out: bool) -> list[list[str]]:
    """The corpus's training documents (all when `data.holdout` is 0), or its held-out ones."""
    from pipefisher.data.corpus import embedded_corpus, read_corpus
    from pipefisher.data.holdout import split_documents

    documents = embedded_corpus() if data.corpus == "embedded" else read_corpus(data.corpus)
    return split_documents(documents, data.holdout)[held_out] if data.holdout or held_out else documents


@functools.cache
def _causal_data(data: DataConfig, seq_len: int, held_out: bool = False):
    from pipefisher.data.causal import CausalLMData
    from pipefisher.data.pretraining import default_cache_dir
    from pipefisher.data.tokenizer import train_byte_level_bpe
    from tokenizers import Tokenizer

    cache = data.cache_dir or str(default_cache_dir())
    documents = _documents(data, held_out)
    if data.tokenizer:  # its errors are reported as data.tokenizer
        if not Path(data.tokenizer).is_file():
            raise ValueError(f"tokenizer: no such file {data.tokenizer}")
        try:
            tokenizer = Tokenizer.from_file(data.tokenizer)
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(
                f"tokenizer: {data.tokenizer} is not a tokenizer.json ({str(exc).splitlines()[0]})"
            ) from None
    else:
        tokenizer = train_byte_level_bpe(_documents(data, False), data.vocab_size, cache)
    return CausalLMData(documents, tokenizer, seq_len, data.micro_batch_size, data.seed, cache)


def causal_data(config: RunConfig):
    """The causal-LM data of the run (built once per process; tokenizer and tokens cached on disk)."""
    return _causal_data(config.data, config.model.seq_len)


@functools.cache
def _pretraining_data(data: DataConfig, seq_len: int, held_out: bool = False):
    from pipefisher.data.pretraining import PretrainingData, default_cache_dir
    from pipefisher.data.tokenizer import load_vocab, train_wordpiece

    cache = data.cache_dir or str(default_cache_dir())
    documents = _documents(data, held_out)
    tokenizer = (
        load_vocab(data.vocab) if data.vocab else train_wordpiece(_documents(data, False), data.vocab_size, cache)
    )
    return PretrainingData(documents, tokenizer, seq_len, data.micro_batch_size, data.seed, data.mask_prob, cache)


def pretraining_data(config: RunConfig):
    """The BERT pretraining data of the run (built once per process; tokenizer and tokens cached on disk)."""
    return _pretraining_data(config.data, config.model.seq_len)


def text_data(config: RunConfig):
    """The run's text data: BERT pretraining (`data.kind: bert`) or causal LM (`causal`); each has
    `tokenizer`, `vocab_size` and `micro_batch`."""
    return pretraining_data(config) if config.data.kind == "bert" else causal_data(config)


def held_out_batches(config: RunConfig, count: int) -> list[dict]:
    """`count` micro-batches of the text run's held-out documents (`data.holdout` > 0; the
    tokenizer is the run's, trained without them), the same for every `data.seed`
    (`pipefisher.data.holdout.evaluation_batches`); ConfigError naming data.holdout otherwise."""
    from pipefisher.data.holdout import evaluation_batches

    if config.data.kind not in ("bert", "causal") or not config.data.holdout:
        raise ConfigError(
            "data.holdout: held-out evaluation needs text data (data.kind bert or causal) and data.holdout > 0"
        )
    data = dataclasses.replace(config.data, seed=0)
    build = _pretraining_data if config.data.kind == "bert" else _causal_data
    return evaluation_batches(build(data, config.model.seq_len, True), count)


def data_source(config: RunConfig) -> MicroBatchFn:
    """(step, global micro-batch) -> batch, a pure function every rank can call."""
    if config.data.kind in ("bert", "causal"):
        return text_data(config).micro_batch
    return SyntheticRegression(config.data, config.model).micro_batch
