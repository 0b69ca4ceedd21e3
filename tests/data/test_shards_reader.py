"""Runs reading prepared shards (`data.kind: shards`): causal packing over the memory-mapped
documents, BERT examples by PretrainingData's builder, samples addressed by a global index in a
seeded order, held-out batches from the valid split, and the errors naming data.shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipefisher.config import ConfigError, DataConfig, config_from_dict
from pipefisher.data.causal import BATCH_KEYS as CAUSAL_KEYS
from pipefisher.data.corpus import embedded_corpus
from pipefisher.data.pretraining import PretrainingData, tokenize_corpus
from pipefisher.data.shards.bert_reader import ShardPretrainingData
from pipefisher.data.shards.causal_reader import ShardCausalData
from pipefisher.data.shards.format import MANIFEST
from pipefisher.data.shards.order import SampleOrder
from pipefisher.data.shards.reader import open_shards
from pipefisher.data.tokenizer import end_of_text_id, train_byte_level_bpe, train_wordpiece
from pipefisher.runtime.training import text_data
from pipefisher.runtime.training.assembly import build_run, data_objective
from shard_folders import sentence_corpus, write_shards

SEQ_LEN, BATCH, STEP_MICRO_BATCHES, SEED = 32, 4, 3, 5


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("shards-cache")


@pytest.fixture(scope="module")
def documents():
    corpus = embedded_corpus()
    return corpus[:80], corpus[80:100]


@pytest.fixture(scope="module")
def bpe(documents, cache):
    return train_byte_level_bpe(documents[0], 300, cache)


@pytest.fixture(scope="module")
def wordpiece(documents, cache):
    return train_wordpiece(documents[0], 500, cache)


@pytest.fixture(scope="module")
def causal_folder(documents, bpe, tmp_path_factory):
    folder = tmp_path_factory.mktemp("causal-shards")
    train, valid = documents
    write_shards(folder, {"train": sentence_corpus(train, bpe), "valid": sentence_corpus(valid, bpe)}, bpe)
    return folder


@pytest.fixture(scope="module")
def bert_folder(documents, wordpiece, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert-shards")
    write_shards(folder, {"train": tokenize_corpus(documents[0], wordpiece)}, wordpiece)
    return folder


def causal(folder, split="train", step_micro_batches=STEP_MICRO_BATCHES, seed=SEED) -> ShardCausalData:
    data = open_shards(folder, split, "causal", SEQ_LEN, BATCH, step_micro_batches, seed)
    assert isinstance(data, ShardCausalData)
    return data


def packed_by_numpy(documents, tokenizer) -> np.ndarray:
    """The documents' sentence tokens, each document followed by end-of-text, cut into sequences."""
    corpus = sentence_corpus(documents, tokenizer)
    end = end_of_text_id(tokenizer)
    stream = np.concatenate(
        [
            np.append(corpus.tokens[corpus.sentence_starts[first] : corpus.sentence_starts[last]], end)
            for first, last in zip(corpus.document_starts[:-1], corpus.document_starts[1:])
        ]
    )
    count = len(stream) // SEQ_LEN
    return stream[: count * SEQ_LEN].reshape(count, SEQ_LEN).astype(np.int64)


def test_causal_packing_equals_numpy_concatenation(causal_folder, documents, bpe):
    expected = packed_by_numpy(documents[0], bpe)
    data = causal(causal_folder)
    assert data.num_sequences == len(expected) > 100
    np.testing.assert_array_equal(data.sequences(np.arange(data.num_sequences)), expected)
    batch = data.micro_batch(2, 1)
    assert tuple(batch) == CAUSAL_KEYS
    assert batch["input_ids"].shape == (BATCH, SEQ_LEN) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["labels"], batch["input_ids"])
    samples = (2 * STEP_MICRO_BATCHES + 1) * BATCH + np.arange(BATCH)
    np.testing.assert_array_equal(batch["input_ids"].numpy(), expected[data.order(samples)])


def test_a_sample_is_read_by_its_global_index_whatever_the_micro_batches_per_step(causal_folder):
    """Sample g = (samples of earlier steps) + micro-batch × size + row: step 1 of 6 micro-batches
    a step reads what steps 2 and 3 of 3 micro-batches a step read."""
    three, six = causal(causal_folder, step_micro_batches=3), causal(causal_folder, step_micro_batches=6)
    for micro_batch in range(6):
        step, within = divmod(6 + micro_batch, 3)
        assert torch.equal(six.micro_batch(1, micro_batch)["input_ids"], three.micro_batch(step, within)["input_ids"])
    assert not torch.equal(
        three.micro_batch(0, 0)["input_ids"], causal(causal_folder, seed=SEED + 1).micro_batch(0, 0)["input_ids"]
    )


def test_every_epoch_reads_each_sequence_once_in_its_own_order(causal_folder):
    data = causal(causal_folder)
    count = data.num_sequences
    first, second = data.order(np.arange(count)), data.order(np.arange(count, 2 * count))
    assert sorted(first) == sorted(second) == list(range(count))
    assert not np.array_equal(first, second) and not np.array_equal(first, np.arange(count))


@pytest.mark.parametrize("count", [1, 2, 3, 7, 64, 1000])
def test_the_order_is_a_bijection_of_each_epoch(count):
    order = SampleOrder(count, seed=3)
    for epoch in range(3):
        assert sorted(order(np.arange(epoch * count, (epoch + 1) * count))) == list(range(count))


def test_bert_batches_are_pretraining_datas_examples_of_the_same_samples(bert_folder, documents, wordpiece, cache):
    """The shard reader builds PretrainingData's examples (one builder, `SentencePairs`) from the
    memory-mapped arrays: sample g starts at candidate order(g) with a generator seeded (seed, g)."""
    reference = PretrainingData(documents[0], wordpiece, 64, BATCH, SEED, cache_dir=cache)
    data = open_shards(bert_folder, "train", "bert", 64, BATCH, STEP_MICRO_BATCHES, SEED)
    assert isinstance(data, ShardPretrainingData)
    assert (
        data.pairs.num_candidates == reference.pairs.num_candidates
        and data.max_predictions == reference.max_predictions
    )
    for step, micro_batch in [(0, 0), (3, 2), (40, 1)]:
        batch = data.micro_batch(step, micro_batch)
        samples = data.samples(step, micro_batch)
        expected = reference.pairs.stack(
            [
                reference.pairs.example(np.random.default_rng([SEED, int(g)]), int(c))
                for g, c in zip(samples, data.order(samples))
            ]
        )
        assert batch.keys() == expected.keys() and all(torch.equal(batch[key], expected[key]) for key in batch)
        today = reference.micro_batch(step, micro_batch)
        for key in batch:
            assert batch[key].shape == today[key].shape and batch[key].dtype == today[key].dtype, key


def test_held_out_batches_are_the_valid_splits(causal_folder):
    data = DataConfig(kind="shards", shards=str(causal_folder), micro_batch_size=BATCH, seed=9)
    batches = text_data.held_out_batches(data, SEQ_LEN, 3, "causal")
    valid = causal(causal_folder, "valid", step_micro_batches=1, seed=0)
    assert len(batches) == 3
    for index, batch in enumerate(batches):
        assert torch.equal(batch["input_ids"], valid.micro_batch(0, index)["input_ids"])


def test_the_errors_name_data_shards(causal_folder, bert_folder, tmp_path):
    def read(folder, objective="causal", held_out=False):
        data = DataConfig(kind="shards", shards=str(folder), micro_batch_size=BATCH)
        return text_data.text_data(data, SEQ_LEN, held_out, objective, STEP_MICRO_BATCHES)

    with pytest.raises(ConfigError, match=r"^data\.shards: .*no manifest\.json.*pipefisher data prepare"):
        read(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"^data\.shards: .*cannot make bert examples.*lacks special token.*\[CLS\]"):
        read(causal_folder, "bert")
    with pytest.raises(ConfigError, match=r"^data\.shards: .*no 'valid' split"):
        read(bert_folder, "bert", held_out=True)
    damaged = tmp_path / "larger"
    write_shards(
        damaged, {"train": sentence_corpus(embedded_corpus()[:5], _tokenizer(causal_folder))}, _tokenizer(causal_folder)
    )
    manifest = json.loads((damaged / MANIFEST).read_text())
    (damaged / MANIFEST).write_text(json.dumps({**manifest, "vocab_size": 100_000}))
    with pytest.raises(ConfigError, match=r"^data\.shards: .*ids span 100000 tokens, more than the 300"):
        read(damaged)


def _tokenizer(folder):
    from pipefisher.data.shards.reader import load_tokenizer

    return load_tokenizer(folder)


def test_the_run_file_takes_shards_for_a_text_model_and_reads_them_for_its_objective(causal_folder, bert_folder):
    gpt2 = {"kind": "hf", "hf_config": "gpt2-tiny", "seq_len": SEQ_LEN}
    with pytest.raises(ConfigError, match=r"^data\.shards: data\.kind shards reads a prepared folder"):
        config_from_dict({"model": gpt2, "data": {"kind": "shards"}})
    with pytest.raises(ConfigError, match=r"^data\.kind: 'shards' does not fit model\.kind 'transformer'"):
        config_from_dict({"data": {"kind": "shards", "shards": str(causal_folder)}})
    config = config_from_dict({"model": gpt2, "data": {"kind": "shards", "shards": str(causal_folder)}})
    assert data_objective(config) == "causal"
    run = build_run(config)
    assert isinstance(run.text_data, ShardCausalData) and run.model.config.vocab_size == 300
    bert = config_from_dict(
        {
            "model": {"kind": "bert", "preset": "bert-tiny", "seq_len": 64},
            "data": {"kind": "shards", "shards": str(bert_folder)},
        }
    )
    assert data_objective(bert) == "bert" and isinstance(build_run(bert).text_data, ShardPretrainingData)
