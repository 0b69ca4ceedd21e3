"""A run's text data from its `data` section: BERT pretraining (`data.kind: bert`), causal LM
(`causal`), or a prepared shard folder read for the model's objective (`shards`), each with
`tokenizer`, `vocab_size` and `micro_batch`; built anew on each call (its tokenizer and tokens are
cached on disk, in `data.cache_dir`; shards are memory-mapped). A run builds it once, through its
`RunParts` (`pipefisher.runtime.training.assembly`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipefisher.config import ConfigError, DataConfig


def _documents(data: DataConfig, held_out: bool) -> list[list[str]]:
    """The corpus's training documents (all when `data.holdout` is 0), or its held-out ones."""
    from pipefisher.data.corpus import embedded_corpus, read_corpus
    from pipefisher.data.holdout import split_documents
    from pipefisher.data.pretraining import default_cache_dir

    cached = data.cache_dir or default_cache_dir()
    documents = embedded_corpus(cached) if data.corpus == "embedded" else read_corpus(data.corpus)
    return split_documents(documents, data.holdout)[held_out] if data.holdout or held_out else documents


def causal_data(data: DataConfig, seq_len: int, held_out: bool = False):
    """The causal-LM data of `data` in sequences of `seq_len` (its held-out documents with `held_out`;
    ValueError starting "tokenizer:" for a `data.tokenizer` that cannot be read)."""
    from tokenizers import Tokenizer

    from pipefisher.data.causal import CausalLMData
    from pipefisher.data.pretraining import default_cache_dir
    from pipefisher.data.tokenizer import train_byte_level_bpe

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


def pretraining_data(data: DataConfig, seq_len: int, held_out: bool = False):
    """The BERT pretraining data of `data` in sequences of `seq_len` (its held-out documents with `held_out`)."""
    from pipefisher.data.pretraining import PretrainingData, default_cache_dir
    from pipefisher.data.tokenizer import load_vocab, train_wordpiece

    cache = data.cache_dir or str(default_cache_dir())
    documents = _documents(data, held_out)
    tokenizer = (
        load_vocab(data.vocab) if data.vocab else train_wordpiece(_documents(data, False), data.vocab_size, cache)
    )
    return PretrainingData(documents, tokenizer, seq_len, data.micro_batch_size, data.seed, data.mask_prob, cache)


def shard_data(data: DataConfig, seq_len: int, objective: str, step_micro_batches: int, held_out: bool = False):
    """The micro-batches of `objective` ("bert" or "causal") read from the prepared folder
    `data.shards`, its train split (its valid split with `held_out`); a step reads
    `step_micro_batches` micro-batches over all replicas. ConfigError naming data.shards for a
    folder that is missing, not prepared, damaged or unfit for `objective`."""
    from pipefisher.data.shards.format import ShardError
    from pipefisher.data.shards.reader import open_shards

    split = "valid" if held_out else "train"
    try:
        return open_shards(
            data.shards, split, objective, seq_len, data.micro_batch_size, step_micro_batches, data.seed, data.mask_prob
        )
    except (ShardError, OSError) as exc:
        raise ConfigError(f"data.shards: {str(exc).splitlines()[0]}") from None


def text_data(data: DataConfig, seq_len: int, held_out: bool = False, objective: str = "", step_micro_batches: int = 1):
    """The text data of `data.kind` bert, causal or shards (read for `objective`, with
    `step_micro_batches` micro-batches a step: `shard_data`)."""
    if data.kind == "shards":
        return shard_data(data, seq_len, objective, step_micro_batches, held_out)
    return (pretraining_data if data.kind == "bert" else causal_data)(data, seq_len, held_out)


def held_out_batches(data: DataConfig, seq_len: int, count: int, objective: str = "") -> list[dict]:
    """`count` micro-batches of the text run's held-out documents (`data.holdout` > 0; the
    tokenizer is the run's, trained without them), or of the valid split of its shards (`data.kind`
    shards, read for `objective`), the same for every `data.seed`
    (`pipefisher.data.holdout.evaluation_batches`); ConfigError naming data.holdout otherwise."""
    from pipefisher.data.holdout import evaluation_batches

    if data.kind == "shards":
        return evaluation_batches(shard_data(dataclasses.replace(data, seed=0), seq_len, objective, 1, True), count)
    if data.kind not in ("bert", "causal") or not data.holdout:
        raise ConfigError(
            "data.holdout: held-out evaluation needs text data (data.kind bert or causal) and data.holdout > 0, "
            "or data.kind shards with a valid split"
        )
    return evaluation_batches(text_data(dataclasses.replace(data, seed=0), seq_len, True), count)
