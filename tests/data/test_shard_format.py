"""The token shard format: what is written reads back, sizes and checksums catch damage."""

from __future__ import annotations

import numpy as np
import pytest

from pipefisher.data.shards.format import (
    DOCUMENTS,
    TOKENS,
    Manifest,
    ShardError,
    SplitWriter,
    open_split,
    token_dtype,
    verify,
)


def _documents(rng: np.random.Generator, count: int, vocab: int) -> list[list[np.ndarray]]:
    return [
        [rng.integers(0, vocab, size=int(rng.integers(1, 9))) for _ in range(int(rng.integers(1, 5)))]
        for _ in range(count)
    ]


def _write(folder, documents, vocab: int, chunk: int = 3) -> Manifest:
    """Documents appended `chunk` at a time, as a parallel preparer hands them over."""
    dtype = token_dtype(vocab)
    writer = SplitWriter(folder / "train", dtype)
    for start in range(0, len(documents), chunk):
        part = documents[start : start + chunk]
        sentences = [s for document in part for s in document]
        writer.append(
            np.concatenate(sentences), np.array([len(s) for s in sentences]), np.array([len(d) for d in part])
        )
    manifest = Manifest(vocab, dtype.str, {"kind": "test"}, {"train": writer.close()})
    manifest.write(folder)
    return manifest


@pytest.mark.parametrize("vocab", [1000, 70_000])
def test_documents_read_back_as_written(tmp_path, vocab):
    documents = _documents(np.random.default_rng(0), 17, vocab)
    _write(tmp_path, documents, vocab)
    split = open_split(tmp_path)
    assert split.tokens.dtype == (np.uint16 if vocab <= 65536 else np.uint32)
    assert split.num_documents == len(documents)
    assert split.num_sentences == sum(len(d) for d in documents)
    for index, document in enumerate(documents):
        np.testing.assert_array_equal(split.document_tokens(index), np.concatenate(document))
        first = split.document_starts[index]
        for offset, sentence in enumerate(document):
            start, end = split.sentence_starts[first + offset], split.sentence_starts[first + offset + 1]
            np.testing.assert_array_equal(split.tokens[start:end], sentence)
    assert verify(tmp_path) == []


def test_damage_is_reported(tmp_path):
    _write(tmp_path, _documents(np.random.default_rng(1), 5, 50), 50)
    tokens = tmp_path / "train" / TOKENS
    data = bytearray(tokens.read_bytes())
    data[0] ^= 0xFF
    tokens.write_bytes(bytes(data))
    assert verify(tmp_path) == [str(tokens)]
    (tmp_path / "train" / DOCUMENTS).write_bytes(b"\0" * 8)
    with pytest.raises(ShardError, match="document_starts.bin: 8 bytes, the manifest says"):
        open_split(tmp_path)
    with pytest.raises(ShardError, match="no 'valid' split"):
        open_split(tmp_path, "valid")


def test_missing_or_foreign_manifest(tmp_path):
    with pytest.raises(ShardError, match="pipefisher data prepare"):
        open_split(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(ShardError, match="format 'other'"):
        open_split(tmp_path)


def test_writer_refuses_bad_input(tmp_path):
    writer = SplitWriter(tmp_path, token_dtype(100))
    with pytest.raises(ValueError, match="does not fit uint16"):
        writer.append(np.array([70_000]), np.array([1]), np.array([1]))
    with pytest.raises(ValueError, match="must sum"):
        writer.append(np.array([1, 2]), np.array([1]), np.array([1]))
    with pytest.raises(ValueError, match="empty"):
        writer.append(np.array([], dtype=np.int64), np.array([0]), np.array([1]))
