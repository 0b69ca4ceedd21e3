import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

from pipefisher.data.corpus import corpus_fingerprint, embedded_corpus
from pipefisher.data.pretraining import (
    BATCH_KEYS,
    IGNORE_INDEX,
    PretrainingData,
    _truncate_pair,
    embedded_pretraining_data,
)
from pipefisher.data.tokenizer import train_wordpiece

SEQ_LEN, BATCH, SEED, VOCAB_SIZE = 64, 8, 11, 1000


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pretraining-cache")


@pytest.fixture(scope="module")
def documents():
    return embedded_corpus()


@pytest.fixture(scope="module")
def tokenizer(documents, cache_dir):
    return train_wordpiece(documents, VOCAB_SIZE, cache_dir)


@pytest.fixture(scope="module")
def data(documents, tokenizer, cache_dir):
    return PretrainingData(documents, tokenizer, SEQ_LEN, BATCH, SEED, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def many(data):
    """200 micro-batches (1600 examples), concatenated per key (an attention mask left out: all ones)."""
    batches = [with_mask(data.micro_batch(step, mb)) for step in range(50) for mb in range(4)]
    return {key: torch.cat([batch[key] for batch in batches]) for key in BATCH_KEYS}


def with_mask(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` with its attention mask, all ones when the micro-batch left it out (no padding)."""
    return {"attention_mask": torch.ones_like(batch["input_ids"])} | batch


def assert_same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_shapes_and_dtypes(data):
    batch = data.micro_batch(0, 0)
    assert tuple(batch) == BATCH_KEYS
    assert BATCH_KEYS == ("input_ids", "token_type_ids", "attention_mask", "mlm_labels", "mlm_positions", "nsp_labels")
    for key in BATCH_KEYS[:4]:
        assert batch[key].shape == (BATCH, SEQ_LEN) and batch[key].dtype == torch.int64, key
    assert data.max_predictions == round(0.15 * (SEQ_LEN - 3)) == 9
    assert batch["mlm_positions"].shape == (BATCH, 9) and batch["mlm_positions"].dtype == torch.int64
    assert batch["nsp_labels"].shape == (BATCH,) and batch["nsp_labels"].dtype == torch.int64
    assert data.vocab_size == VOCAB_SIZE and data.special.pad == 0 and data.special.mask == 4


def test_micro_batch_is_a_pure_function_of_seed_step_and_id(documents, tokenizer, data, cache_dir):
    other = PretrainingData(documents, tokenizer, SEQ_LEN, BATCH, SEED)
    ids = [(0, 0), (0, 1), (1, 0), (3, 2), (7, 0)]
    first = {i: data.micro_batch(*i) for i in ids}
    second = {i: other.micro_batch(*i) for i in reversed(ids)}
    for i in ids:
        assert_same(first[i], second[i])
        assert_same(first[i], data.micro_batch(*i))
    inputs = [first[i]["input_ids"] for i in ids]
    assert all(not torch.equal(a, b) for a, b in itertools.combinations(inputs, 2))
    reseeded = PretrainingData(documents, tokenizer, SEQ_LEN, BATCH, SEED + 1, cache_dir=cache_dir)
    assert not torch.equal(reseeded.micro_batch(0, 0)["input_ids"], first[(0, 0)]["input_ids"])


def test_same_corpus_and_micro_batch_in_a_fresh_process(documents, data, cache_dir):
    # The fresh process imports torch before building the corpus (torch monkey-patches `inspect`).
    code = (
        "import sys, torch\n"
        "from pipefisher.data.corpus import corpus_fingerprint, embedded_corpus\n"
        "from pipefisher.data.pretraining import PretrainingData\n"
        "from pipefisher.data.tokenizer import train_wordpiece\n"
        f"documents, cache = embedded_corpus(), {str(cache_dir)!r}\n"
        f"data = PretrainingData(documents, train_wordpiece(documents, {VOCAB_SIZE}, cache), {SEQ_LEN}, {BATCH}, {SEED}, cache_dir=cache)\n"
        "torch.save(data.micro_batch(5, 3), sys.argv[1])\n"
        "print(corpus_fingerprint(documents))\n"
    )
    path = cache_dir / "from-subprocess.pt"
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == corpus_fingerprint(documents)
    assert_same(torch.load(path), data.micro_batch(5, 3))


def test_special_token_layout(data, many):
    special = data.special
    ids, types, attention = many["input_ids"], many["token_type_ids"], many["attention_mask"]
    assert (ids[:, 0] == special.cls).all() and (ids == special.cls).sum() == len(ids)
    assert ((ids == special.sep).sum(dim=1) == 2).all()
    positions = torch.arange(SEQ_LEN).expand_as(ids)
    sep = torch.where(ids == special.sep, positions, SEQ_LEN)
    first_sep = sep.min(dim=1, keepdim=True).values
    second_sep = torch.where(positions > first_sep, sep, SEQ_LEN).min(dim=1, keepdim=True).values
    assert (first_sep >= 2).all() and (second_sep > first_sep + 1).all()
    assert torch.equal(types, ((positions > first_sep) & (positions <= second_sep)).long())
    assert torch.equal(attention, (positions <= second_sep).long())
    assert torch.equal(attention, (ids != special.pad).long())
    assert attention.float().mean() > 0.9, "segments should nearly fill the sequence"


def test_masking_rates(data, many):
    special = data.special
    ids, labels, attention = many["input_ids"], many["mlm_labels"], many["attention_mask"]
    labelled = labels != IGNORE_INDEX
    candidates = (attention == 1) & (ids != special.cls) & (ids != special.sep)
    assert not (labelled & ~candidates).any()
    assert labelled.any(dim=1).all()
    assert (ids[~labelled] != special.mask).all()
    assert ((labels[labelled] >= 5) | (labels[labelled] == special.unk)).all()
    per_example = labelled.sum(1).float() / candidates.sum(1).float()
    assert abs(per_example.mean().item() - 0.15) < 0.01
    masked = (ids[labelled] == special.mask).float().mean().item()
    kept = (ids[labelled] == labels[labelled]).float().mean().item()
    randomised = 1 - masked - kept
    assert abs(masked - 0.8) < 0.03 and abs(kept - 0.1) < 0.025 and abs(randomised - 0.1) < 0.025
    assert (ids[labelled & (ids != special.mask) & (ids != labels)] >= 5).all()


def test_mlm_positions_list_each_labelled_position_once(data, many):
    labelled, positions = many["mlm_labels"] != IGNORE_INDEX, many["mlm_positions"]
    counts = labelled.sum(dim=1)
    assert counts.max() == data.max_predictions, "the width is reached, so it is no wider than needed"
    slots = torch.arange(data.max_predictions).expand_as(positions)
    used = slots < counts[:, None]
    assert torch.equal(positions[~used], torch.zeros_like(positions[~used])), "the rest of a row points at [CLS]"
    assert not labelled[:, 0].any()
    found = torch.zeros_like(labelled).scatter(1, positions, used)
    assert torch.equal(found, labelled) and (positions[:, 1:][used[:, 1:]] > positions[:, :-1][used[:, 1:]]).all()


def test_attention_mask_is_left_out_exactly_when_nothing_is_padded(data):
    batches = [data.micro_batch(0, mb) for mb in range(16)]
    unpadded = [(batch["input_ids"] != data.special.pad).all().item() for batch in batches]
    assert any(unpadded) and not all(unpadded), "both kinds occur at this length and micro-batch size"
    for batch, full in zip(batches, unpadded):
        assert ("attention_mask" not in batch) == full
        assert tuple(key for key in BATCH_KEYS if key in batch) == tuple(batch)


def test_nsp_labels_are_balanced(many):
    assert 0.45 < many["nsp_labels"].float().mean().item() < 0.55


def _occurs(tokens: np.ndarray, segment: np.ndarray, at: np.ndarray | None = None) -> bool:
    """Whether `segment` occurs in `tokens` (starting at one of the positions `at`, if given)."""
    starts = np.flatnonzero(tokens[: len(tokens) - len(segment) + 1] == segment[0]) if at is None else at
    return any(np.array_equal(tokens[s : s + len(segment)], segment) for s in starts)


def test_segments_come_from_the_corpus(data):
    corpus, special = data.corpus, data.special
    for step in range(6):
        batch = with_mask(data.micro_batch(step, 0))
        original = torch.where(batch["mlm_labels"] == IGNORE_INDEX, batch["input_ids"], batch["mlm_labels"]).numpy()
        for row, is_random in zip(original, batch["nsp_labels"].tolist()):
            first_sep, second_sep = np.flatnonzero(row == special.sep)
            a, b = row[1:first_sep], row[first_sep + 1 : second_sep]
            if is_random:
                assert _occurs(corpus.tokens, a)
                assert _occurs(corpus.tokens, b, at=corpus.sentence_starts[:-1])
            else:
                assert _occurs(corpus.tokens, np.concatenate([a, b]))


def test_truncation_matches_berts_loop():
    def reference(len_a, len_b, budget):
        while len_a + len_b > budget:
            if len_a > len_b:
                len_a -= 1
            else:
                len_b -= 1
        return len_a, len_b

    for len_a, len_b, budget in itertools.product(range(1, 14), range(1, 14), range(2, 16)):
        assert _truncate_pair(len_a, len_b, budget) == reference(len_a, len_b, budget)


def test_bad_arguments_are_rejected(documents, tokenizer, data):
    with pytest.raises(ValueError, match="seq_len"):
        PretrainingData(documents, tokenizer, 4, BATCH, SEED)
    with pytest.raises(ValueError, match="mask_prob"):
        PretrainingData(documents, tokenizer, SEQ_LEN, BATCH, SEED, mask_prob=0.0)
    with pytest.raises(ValueError, match="at least 2 documents"):
        PretrainingData(documents[:1], tokenizer, SEQ_LEN, BATCH, SEED)
    with pytest.raises(ValueError, match=">= 0"):
        data.micro_batch(-1, 0)


def test_embedded_pretraining_data_uses_the_cache_dir(data, cache_dir, monkeypatch):
    monkeypatch.setenv("PIPEFISHER_CACHE", str(cache_dir))
    before = sorted(p.name for p in cache_dir.iterdir())
    demo = embedded_pretraining_data(SEQ_LEN, BATCH, SEED, vocab_size=VOCAB_SIZE)
    added = sorted(set(p.name for p in cache_dir.iterdir()) - set(before))
    assert len(added) == 1 and added[0].startswith("embedded-corpus-"), "the tokenizer and tokens are reused"
    assert any(name.startswith("wordpiece-") for name in before) and any(name.startswith("tokens-") for name in before)
    assert_same(demo.micro_batch(2, 1), data.micro_batch(2, 1))
