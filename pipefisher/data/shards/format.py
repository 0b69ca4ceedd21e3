"""The on-disk format of prepared token shards (`pipefisher-shards-v1`). Pure numpy: no torch.

A prepared folder::

    manifest.json                 format, tokenizer, vocabulary size, token dtype, per split its
                                  counts and the SHA-256 of each file (`Manifest`)
    tokenizer.json                the tokenizer the ids come from (a `tokenizers` JSON), if it has one
    <split>/tokens.bin            token ids without special tokens, little-endian uint16 when the
                                  vocabulary fits in 65,536 ids, else uint32
    <split>/sentence_starts.bin   int64, S + 1 entries: sentence i is tokens[s[i]:s[i+1]], never empty
    <split>/document_starts.bin   int64, D + 1 entries: document d is sentences d[d]:d[d+1], at least one

Splits are "train" and, when documents were held out, "valid". Every array is read with
`np.memmap`: opening a split costs no memory proportional to the corpus. Readers add the
special tokens their objective needs (end-of-text between documents, [CLS]/[SEP] around pairs).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "pipefisher-shards-v1"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENS, SENTENCES, DOCUMENTS = "tokens.bin", "sentence_starts.bin", "document_starts.bin"
SPLITS = ("train", "valid")
_OFFSET_DTYPE = np.dtype("<i8")
_BUFFER_TOKENS = 1 << 22  # tokens held before a write: bounds the writer's memory (~16 MiB)


class ShardError(ValueError):
    """A shard folder that cannot be read: the message names the path and how to fix it."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a `vocab_size` vocabulary fits in it, else uint32 (little-endian)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size: expected a positive count, got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True)
class SplitInfo:
    """Counts of one split and the SHA-256 hex digest of each of its files (by file name)."""

    tokens: int
    sentences: int
    documents: int
    sha256: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    """What a prepared folder holds. `tokenizer`: how the ids were made (kind, source, and the
    SHA-256 of its serialised form); `source`: what was read (inputs, document count, options)."""

    vocab_size: int
    dtype: str
    tokenizer: dict[str, str]
    splits: dict[str, SplitInfo]
    source: dict[str, object] = field(default_factory=dict)
    format: str = FORMAT

    def write(self, folder: Path) -> None:
        """Write manifest.json last of all: its presence marks the folder complete."""
        text = json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"
        partial = folder / f".{MANIFEST}.tmp"
        partial.write_text(text)
        partial.replace(folder / MANIFEST)

    @classmethod
    def read(cls, folder: str | Path) -> Manifest:
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise ShardError(
                f"{folder}: no {MANIFEST}, not a prepared shard folder (or preparing it did not finish); "
                f"make one with `pipefisher data prepare`"
            )
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise ShardError(
                    f"{path}: format {raw.get('format')!r}, this pipefisher reads {FORMAT!r}; prepare it again"
                )
            splits = {name: SplitInfo(**info) for name, info in raw.pop("splits").items()}
            return cls(splits=splits, **raw)
        except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as exc:
            raise ShardError(f"{path}: not a shard manifest ({exc}); prepare the folder again") from None


class SplitWriter:
    """Streams one split to `folder` (created): `append` whole documents in order, then `close`.
    Memory stays bounded by the write buffer whatever the corpus size."""

    def __init__(self, folder: Path, dtype: np.dtype):
        folder.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self._files = {name: open(folder / name, "wb") for name in (TOKENS, SENTENCES, DOCUMENTS)}
        self._hashes = {name: hashlib.sha256() for name in self._files}
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self.tokens = self.sentences = self.documents = 0
        self._write(SENTENCES, np.zeros(1, _OFFSET_DTYPE))
        self._write(DOCUMENTS, np.zeros(1, _OFFSET_DTYPE))

    def append(self, tokens: np.ndarray, sentence_lengths: np.ndarray, document_sizes: np.ndarray) -> None:
        """Add documents: `tokens` of their sentences back to back, `sentence_lengths` (each > 0,
        summing to len(tokens)) and `document_sizes` (sentences per document, each > 0, summing
        to len(sentence_lengths))."""
        sentence_lengths = np.asarray(sentence_lengths, dtype=np.int64)
        document_sizes = np.asarray(document_sizes, dtype=np.int64)
        if int(sentence_lengths.sum()) != len(tokens) or int(document_sizes.sum()) != len(sentence_lengths):
            raise ValueError("append: sentence lengths must sum to the tokens and document sizes to the sentences")
        if (sentence_lengths <= 0).any() or (document_sizes <= 0).any():
            raise ValueError("append: empty sentences or documents cannot be stored")
        if len(tokens) and int(np.max(tokens)) > np.iinfo(self.dtype).max:
            raise ValueError(f"append: token id {int(np.max(tokens))} does not fit {self.dtype.name}")
        self._pending.append(np.asarray(tokens).astype(self.dtype, copy=False))
        self._pending_tokens += len(tokens)
        self._write(SENTENCES, self.tokens + np.cumsum(sentence_lengths))
        self._write(DOCUMENTS, self.sentences + np.cumsum(document_sizes))
        self.tokens += len(tokens)
        self.sentences += len(sentence_lengths)
        self.documents += len(document_sizes)
        if self._pending_tokens >= _BUFFER_TOKENS:
            self._flush()

    def close(self) -> SplitInfo:
        """Flush and close the files; the split's counts and checksums."""
        self._flush()
        for file in self._files.values():
            file.close()
        digests = {name: digest.hexdigest() for name, digest in self._hashes.items()}
        return SplitInfo(self.tokens, self.sentences, self.documents, digests)

    def _flush(self) -> None:
        if self._pending:
            self._write(TOKENS, np.concatenate(self._pending))
        self._pending, self._pending_tokens = [], 0

    def _write(self, name: str, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array, dtype=self.dtype if name == TOKENS else _OFFSET_DTYPE).tobytes()
        self._files[name].write(data)
        self._hashes[name].update(data)


@dataclass(frozen=True)
class ShardSplit:
    """One split, memory-mapped read-only: `tokens` (T,), `sentence_starts` (S + 1,) and
    `document_starts` (D + 1,) as the module docstring lays them out."""

    tokens: np.ndarray
    sentence_starts: np.ndarray
    document_starts: np.ndarray

    @property
    def num_documents(self) -> int:
        return len(self.document_starts) - 1

    @property
    def num_sentences(self) -> int:
        return len(self.sentence_starts) - 1

    def document_tokens(self, document: int) -> np.ndarray:
        """The tokens of `document`'s sentences back to back (a view of the mapped file)."""
        first, last = self.document_starts[document], self.document_starts[document + 1]
        return self.tokens[self.sentence_starts[first] : self.sentence_starts[last]]


def open_split(folder: str | Path, split: str = "train") -> ShardSplit:
    """Memory-map `split` of a prepared folder, its sizes checked against the manifest
    (ShardError naming the file otherwise)."""
    manifest = Manifest.read(folder)
    if split not in manifest.splits:
        have = ", ".join(manifest.splits)
        raise ShardError(f"{folder}: no {split!r} split (it has {have}); prepare it with a held-out share for 'valid'")
    info, base = manifest.splits[split], Path(folder) / split
    expected = {TOKENS: info.tokens, SENTENCES: info.sentences + 1, DOCUMENTS: info.documents + 1}
    arrays = {}
    for name, count in expected.items():
        dtype = np.dtype(manifest.dtype) if name == TOKENS else _OFFSET_DTYPE
        path = base / name
        size = path.stat().st_size if path.is_file() else -1
        if size != count * dtype.itemsize:
            raise ShardError(
                f"{path}: {'missing' if size < 0 else f'{size} bytes'}, the manifest says {count * dtype.itemsize}; "
                f"the folder is damaged, prepare it again"
            )
        # an empty file cannot be mapped; an empty split reads as an empty array
        arrays[name] = np.memmap(path, dtype=dtype, mode="r") if count else np.zeros(0, dtype)
    return ShardSplit(arrays[TOKENS], arrays[SENTENCES], arrays[DOCUMENTS])


def file_sha256(path: Path, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def verify(folder: str | Path) -> list[str]:
    """Files of a prepared folder whose SHA-256 differs from the manifest's (paths; empty when intact)."""
    manifest = Manifest.read(folder)
    return [
        str(Path(folder) / split / name)
        for split, info in manifest.splits.items()
        for name, digest in info.sha256.items()
        if not (Path(folder) / split / name).is_file() or file_sha256(Path(folder) / split / name) != digest
    ]
