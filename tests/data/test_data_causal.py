"""Causal-LM data: byte-level BPE trained on the corpus, documents packed into fixed-length
sequences split by end-of-text, micro-batches a pure function of (seed, step, micro-batch)."""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from pipefisher.data.causal import BATCH_KEYS, CausalLMData, tokenize_documents
from pipefisher.data.corpus import embedded_corpus
from pipefisher.data.tokenizer import END_OF_TEXT, end_of_text_id, train_byte_level_bpe

SEQ_LEN, BATCH, SEED, VOCAB_SIZE = 32, 4, 7, 600


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("causal-cache")


@pytest.fixture(scope="module")
def documents():
    return embedded_corpus()


@pytest.fixture(scope="module")
def tokenizer(documents, cache_dir):
    return train_byte_level_bpe(documents, VOCAB_SIZE, cache_dir)


@pytest.fixture(scope="module")
def data(documents, tokenizer, cache_dir):
    return CausalLMData(documents, tokenizer, SEQ_LEN, BATCH, SEED, cache_dir)


def test_the_bpe_tokenizer_covers_every_byte_and_decodes_what_it_encodes(tokenizer):
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert end_of_text_id(tokenizer) == 0 and tokenizer.id_to_token(0) == END_OF_TEXT
    text = "Return the naïve value — of an unseen wörd ✓."
    encoding = tokenizer.encode(text)
    assert tokenizer.decode(encoding.ids) == text, "no byte is lost: characters the corpus never had included"


def test_a_cached_tokenizer_is_the_one_every_later_call_returns(documents, cache_dir, tokenizer):
    again = train_byte_level_bpe(documents, VOCAB_SIZE, cache_dir)
    assert again.to_str() == tokenizer.to_str()
    assert len(list(cache_dir.glob(f"bpe-{VOCAB_SIZE}-*.json"))) == 1


def test_sequences_are_the_documents_packed_with_end_of_text_between_them(documents, tokenizer, data):
    stream = tokenize_documents(documents, tokenizer)
    assert np.count_nonzero(stream == 0) == len(documents), "one end-of-text per document"
    first = tokenizer.encode(" ".join(documents[0]), add_special_tokens=False).ids
    np.testing.assert_array_equal(stream[: len(first) + 1], [*first, 0])
    count = len(stream) // SEQ_LEN
    np.testing.assert_array_equal(data.sequences, stream[: count * SEQ_LEN].reshape(count, SEQ_LEN))


def test_micro_batches_are_a_pure_function_of_seed_step_and_micro_batch(documents, tokenizer, data, cache_dir):
    batch = data.micro_batch(3, 5)
    assert set(batch) == set(BATCH_KEYS)
    assert all(value.shape == (BATCH, SEQ_LEN) and value.dtype == torch.int64 for value in batch.values())
    assert torch.equal(batch["labels"], batch["input_ids"]) and tuple(batch) == BATCH_KEYS == ("input_ids", "labels")
    rows = {tuple(row) for row in data.sequences.tolist()}
    assert all(tuple(row) in rows for row in batch["input_ids"].tolist()), "every row is one packed sequence"
    other = CausalLMData(documents, tokenizer, SEQ_LEN, BATCH, SEED, cache_dir)
    assert all(torch.equal(batch[key], other.micro_batch(3, 5)[key]) for key in BATCH_KEYS)
    assert not torch.equal(batch["input_ids"], data.micro_batch(3, 6)["input_ids"])
    assert not torch.equal(
        batch["input_ids"],
        CausalLMData(documents, tokenizer, SEQ_LEN, BATCH, SEED + 1, cache_dir).micro_batch(3, 5)["input_ids"],
    )


def test_a_tokenizer_without_end_of_text_and_a_corpus_too_short_are_refused(documents, tokenizer):
    with pytest.raises(ValueError, match="tokenizer has no end-of-text token"):
        CausalLMData(documents, Tokenizer(models.BPE()), SEQ_LEN, BATCH, SEED)
    with pytest.raises(ValueError, match="fewer than one sequence of seq_len 100000"):
        CausalLMData(documents[:1], tokenizer, 100_000, BATCH, SEED)
