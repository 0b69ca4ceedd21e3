"""Documents -> a prepared shard folder (`format`), tokenized in parallel, written in order.

The parent reads the inputs document by document and cuts them into chunks of at most
`CHUNK_DOCUMENTS` documents and `CHUNK_CHARS` characters; a pool of `workers` processes encodes
each chunk (one batch encode); the parent appends the results to the split writers in input
order, holding at most `2 * workers` chunks at a time. The output is therefore the same bytes
for any worker count, and memory does not grow with the corpus.

Sentence k > 0 of a document is encoded with the space that joins it to the one before
(" " + sentence): a document's ids are then those of its sentences joined by spaces, the text
`causal.tokenize_documents` encodes, for byte-level BPE as for WordPiece. Special ids
(`ResolvedTokenizer.strip_ids`) are removed; sentences left empty are dropped, then documents
left without a sentence. Document i (counted over the inputs from 0) goes to `valid` when
`held_out(i, fraction, seed)`, else to `train`.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import resource
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipefisher.core.usage import UsageError
from pipefisher.data.shards.format import (
    MANIFEST,
    SPLITS,
    TOKENIZER_FILE,
    Manifest,
    SplitInfo,
    SplitWriter,
    token_dtype,
)
from pipefisher.data.shards.tokenizing import Encoder, ResolvedTokenizer

CHUNK_DOCUMENTS = 256
CHUNK_CHARS = 1 << 20


def held_out(document: list[str], fraction: float, seed: int) -> bool:
    """Whether `document` goes to the held-out split: a hash of (seed, its sentences) mapped to
    [0, 1) falls below `fraction`. Decided by content, so every copy of a document (a repeated
    pass over a corpus, a duplicate in the inputs) lands in the same split: no held-out text is
    ever trained on."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(str(seed).encode(), digest_size=8)
    for sentence in document:
        digest.update(sentence.encode("utf-8"))
        digest.update(b"\x1f")
    return int.from_bytes(digest.digest(), "little") / 2**64 < fraction


@dataclass(frozen=True)
class Chunk:
    """Documents `first`, `first + 1`, ... of the inputs."""

    first: int
    documents: list[list[str]]


@dataclass
class EncodedSplit:
    """Documents of one split, as `SplitWriter.append` takes them."""

    tokens: np.ndarray
    sentence_lengths: np.ndarray
    document_sizes: np.ndarray


@dataclass
class EncodedChunk:
    splits: dict[str, EncodedSplit]
    dropped: int  # documents left without a sentence
    tokens: int


def chunks(documents: Iterable[list[str]]) -> Iterator[Chunk]:
    """`documents` cut into chunks of at most CHUNK_DOCUMENTS documents and about CHUNK_CHARS characters."""
    batch: list[list[str]] = []
    first = chars = 0
    for document in documents:
        batch.append(document)
        chars += sum(map(len, document))
        if len(batch) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
            yield Chunk(first, batch)
            first, batch, chars = first + len(batch), [], 0
    if batch:
        yield Chunk(first, batch)


class ChunkEncoder:
    """Encodes chunks (in a worker, or in the parent for one worker)."""

    def __init__(self, resolved: ResolvedTokenizer, holdout: float, holdout_seed: int):
        self.encode = Encoder(resolved)
        self.strip = np.array(resolved.strip_ids, dtype=np.int64)
        self.vocab_size = resolved.vocab_size
        self.dtype = token_dtype(resolved.vocab_size)
        self.holdout, self.seed = holdout, holdout_seed

    def __call__(self, chunk: Chunk) -> EncodedChunk:
        texts = [
            sentence if k == 0 else " " + sentence
            for document in chunk.documents
            for k, sentence in enumerate(document)
        ]
        ids = self.encode(texts)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens = np.fromiter((i for sentence in ids for i in sentence), dtype=np.int64, count=int(lengths.sum()))
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"the tokenizer made id {int(tokens.max())}, outside its vocabulary of {self.vocab_size}")
        if len(self.strip):
            keep = ~np.isin(tokens, self.strip)
            sentence_of_token = np.repeat(np.arange(len(ids)), lengths)
            tokens, lengths = tokens[keep], np.bincount(sentence_of_token[keep], minlength=len(ids))
        document_of_sentence = np.repeat(np.arange(len(chunk.documents)), [len(d) for d in chunk.documents])
        sizes = np.bincount(document_of_sentence[lengths > 0], minlength=len(chunk.documents))
        valid = np.array([held_out(document, self.holdout, self.seed) for document in chunk.documents], dtype=bool)
        splits = {}
        for name, documents in (("train", ~valid & (sizes > 0)), ("valid", valid & (sizes > 0))):
            sentences = documents[document_of_sentence] & (lengths > 0)
            splits[name] = EncodedSplit(
                tokens[np.repeat(sentences, lengths)].astype(self.dtype), lengths[sentences], sizes[documents]
            )
        return EncodedChunk(splits, int((sizes == 0).sum()), len(tokens))


_WORKER: ChunkEncoder | None = None


def _start_worker(resolved: ResolvedTokenizer, holdout: float, holdout_seed: int) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER = ChunkEncoder(resolved, holdout, holdout_seed)


def _encode_in_worker(chunk: Chunk) -> EncodedChunk:
    assert _WORKER is not None, "the pool's initializer builds the encoder"
    return _WORKER(chunk)


def encoded_in_order(
    documents: Iterable[list[str]], resolved: ResolvedTokenizer, workers: int, holdout: float, holdout_seed: int
) -> Iterator[EncodedChunk]:
    """The encoded chunks of `documents` in input order; `workers` > 1 encode in a process pool
    with at most 2 * workers chunks in flight (bounded memory, unlike Pool.imap that reads all its input ahead)."""
    if workers == 1:
        encoder = ChunkEncoder(resolved, holdout, holdout_seed)
        yield from map(encoder, chunks(documents))
        return
    context = multiprocessing.get_context("spawn")  # no fork of a parent whose tokenizers threads have run
    with context.Pool(workers, initializer=_start_worker, initargs=(resolved, holdout, holdout_seed)) as pool:
        pending: deque = deque()
        for chunk in chunks(documents):
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
        pool.join()


@dataclass(frozen=True)
class Summary:
    """One preparation: counts, bytes of the folder, wall time [s], CPU time of this process and
    its workers [s], throughput [tokens/s] and the peak resident memory [MiB] of this process and
    of its largest worker."""

    folder: str
    documents: int
    dropped_documents: int
    splits: dict[str, SplitInfo]
    bytes_on_disk: int
    seconds: float
    cpu_seconds: float
    peak_rss_mib: float
    worker_peak_rss_mib: float
    workers: int
    tokenizer: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(info.tokens for info in self.splits.values())

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def check_out_folder(out: Path, overwrite: bool) -> None:
    """UsageError unless `out` is absent, empty, a finished prepared folder, or `overwrite`."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT {out}: is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file() and not overwrite:
        raise UsageError(f"OUT {out}: not empty and not a prepared shard folder; give an empty folder or --overwrite")


def _clear(out: Path) -> None:
    """Remove the format's files from `out`, the manifest first: a folder being written has none."""
    (out / MANIFEST).unlink(missing_ok=True)
    (out / TOKENIZER_FILE).unlink(missing_ok=True)
    for split in SPLITS:
        shutil.rmtree(out / split, ignore_errors=True)


def _cpu_seconds() -> float:
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def _peak_rss_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


def prepare(
    documents: Iterable[list[str]],
    resolved: ResolvedTokenizer,
    out: Path,
    workers: int,
    holdout: float = 0.0,
    holdout_seed: int = 0,
    source: dict[str, object] | None = None,
    progress: bool = True,
) -> Summary:
    """Tokenize `documents` into the prepared folder `out` (see the module docstring); the
    manifest is written last. `progress`: a tqdm bar of tokens on stderr."""
    from tqdm import tqdm

    start, cpu_start = time.perf_counter(), _cpu_seconds()
    out.mkdir(parents=True, exist_ok=True)
    _clear(out)
    if resolved.json is not None:
        (out / TOKENIZER_FILE).write_text(resolved.json)
    dtype = token_dtype(resolved.vocab_size)
    names = SPLITS if holdout > 0 else SPLITS[:1]
    writers = {name: SplitWriter(out / name, dtype) for name in names}
    read = dropped = 0
    with tqdm(unit="tok", unit_scale=True, file=sys.stderr, disable=not progress, dynamic_ncols=True) as bar:
        for encoded in encoded_in_order(documents, resolved, workers, holdout, holdout_seed):
            for name, writer in writers.items():
                part = encoded.splits[name]
                if len(part.document_sizes):
                    writer.append(part.tokens, part.sentence_lengths, part.document_sizes)
            read += sum(len(part.document_sizes) for part in encoded.splits.values()) + encoded.dropped
            dropped += encoded.dropped
            bar.update(encoded.tokens)
    splits = {name: writer.close() for name, writer in writers.items()}
    manifest_source = {**(source or {}), "documents_read": read, "documents_dropped": dropped}
    if holdout > 0:
        manifest_source.update(holdout=holdout, holdout_seed=holdout_seed)
    Manifest(resolved.vocab_size, dtype.str, resolved.manifest_entry(), splits, manifest_source).write(out)
    return Summary(
        folder=str(out),
        documents=read,
        dropped_documents=dropped,
        splits=splits,
        bytes_on_disk=sum(path.stat().st_size for path in out.rglob("*") if path.is_file()),
        seconds=time.perf_counter() - start,
        cpu_seconds=_cpu_seconds() - cpu_start,
        peak_rss_mib=_peak_rss_mib(resource.RUSAGE_SELF),
        worker_peak_rss_mib=_peak_rss_mib(resource.RUSAGE_CHILDREN),
        workers=workers,
        tokenizer=resolved.manifest_entry(),
    )
