"""The built-in model kinds' builders (`pipefisher.models.kinds` names them): each takes the run's
`RunParts` (`pipefisher.runtime.training.assembly`) and returns its `StagedModel`, ConfigError
naming the key for what the run file cannot be built as. A model that reads text data calls
`run.data_ready()` once its split is valid, then takes `run.text_data`, which the run's data
source shares."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pipefisher.config import ConfigError, RunConfig, check_stage_blocks, split_hint, stage_count_terms
from pipefisher.models import StagedModel
from pipefisher.models.tiny import TinyRegression
from pipefisher.runtime.errors import first_line
from pipefisher.runtime.training.hf_skeleton import hf_staged

if TYPE_CHECKING:
    from pipefisher.runtime.training.assembly import RunParts


def regression_model(run: RunParts) -> StagedModel:
    """The builder of model.kind transformer and mlp: the regression model (its data is synthetic)."""
    return TinyRegression(run.config.model, run.config.pipeline.stage_blocks)


def bert_model(run: RunParts) -> StagedModel:
    """The builder of model.kind bert: a preset or `model.config_json`, split-checked, with the
    vocabulary of the run's pretraining data."""
    from pipefisher.models.bert import BertConfig, BertStagedModel, bert_preset

    config = run.config
    settings = config.model
    try:
        bert = BertConfig.from_json(settings.config_json) if settings.config_json else bert_preset(settings.preset)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"model: {first_line(exc)}") from None
    _check_split(config, bert.num_hidden_layers, f"{bert.num_hidden_layers} BERT layers", "num_hidden_layers")
    if settings.seq_len > bert.max_position_embeddings:
        raise ConfigError(
            f"model.seq_len: {settings.seq_len} exceeds the model's {bert.max_position_embeddings} positions"
        )
    run.data_ready("bert")
    bert = dataclasses.replace(bert, vocab_size=run.text_data.vocab_size)
    if settings.dropout >= 0:
        bert = dataclasses.replace(
            bert, hidden_dropout_prob=settings.dropout, attention_probs_dropout_prob=settings.dropout
        )
    return BertStagedModel(bert, settings.seq_len, config.pipeline.stage_blocks)


def _check_split(config: RunConfig, count: int, what: str, field: str) -> None:
    """ConfigError unless the run's stages split a model of `count` layers/blocks (`what`, counted
    by the model's `field`): evenly, or as `pipeline.stage_blocks` says."""
    if config.pipeline.stage_blocks:
        check_stage_blocks(config.pipeline, config.model.kind, count, field)
    elif count % config.model_chunks:
        _, product = stage_count_terms(config.pipeline)
        raise ConfigError(
            f"model: {what} cannot be split into {config.model_chunks} equal stages; {split_hint(count, product)}"
        )


def hf_model(run: RunParts) -> StagedModel:
    """The builder of model.kind hf, the run's Hugging Face model: its config with the run's dropout,
    vocabulary and special ids, checked against the run's stages and data before the data is built."""
    config = run.config
    settings = config.model
    stage_blocks = config.pipeline.stage_blocks
    model = hf_staged(settings, stage_blocks=stage_blocks)
    _check_split(config, model.num_blocks, f"{model.num_blocks} blocks of {model.layout.blocks}", "its config's layers")
    try:
        model.check_split(config.model_chunks)
        model.recompute_plan(settings.recompute)  # refused before the data is built
    except ValueError as exc:
        raise ConfigError(f"model.{exc}") from None
    if model.layout.data != config.data.kind and config.data.kind != "shards":
        raise ConfigError(
            f"data.kind: {config.data.kind!r} does not fit {model.cls.__name__}; it needs data.kind {model.layout.data}"
        )
    run.data_ready(model.layout.data)
    try:
        data = run.text_data
    except ConfigError:
        raise
    except (ValueError, OSError) as exc:
        message = str(exc).splitlines()[0]
        raise ConfigError(
            f"data.{message}" if message.startswith(("tokenizer:", "holdout:")) else f"data: {message}"
        ) from None
    if settings.hf_weights:
        if data.vocab_size > model.config.vocab_size:
            fix = (
                "data.shards: prepare the shards with the checkpoint's tokenizer"
                if config.data.kind == "shards"
                else "data: give data.tokenizer the checkpoint's tokenizer.json"
            )
            key, _, advice = fix.partition(": ")
            raise ConfigError(
                f"{key}: the tokenizer has {data.vocab_size} tokens, more than the {model.config.vocab_size} of "
                f"model.hf_weights; {advice}"
            )
        return model
    special = (
        {"pad_token_id": data.special.pad}
        if model.layout.data == "bert"
        else {"bos_token_id": data.end_of_text, "eos_token_id": data.end_of_text, "pad_token_id": None}
    )
    return hf_staged(settings, (("vocab_size", data.vocab_size), *special.items()), stage_blocks)
