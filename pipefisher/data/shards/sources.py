"""Inputs of `pipefisher data prepare`, read as a stream of documents (lists of sentences).

Four kinds, told apart by the input's spelling (`open_input`):
- `embedded`: the English text shipped with Python (`corpus.embedded_corpus`, small, held in
  memory), passed over `repeat` times, each pass in a seeded shuffled order when a seed is given;
- a folder: a Hugging Face `datasets` dataset (`save_to_disk` folder, or any folder
  `load_dataset` reads offline), one document per row of its `field` column;
- a `.jsonl` / `.json` file: JSON lines, one document per line in its `field`;
- any other file: text, one sentence per line with blank lines between documents (the
  pretraining format), or plain prose (a document per paragraph), told apart from its head.
Prose and JSON texts are split with the project's splitter (`corpus.split_sentences`).
Every kind but `embedded` is streamed: a document is read when it is wanted, never the file.
Documents without a sentence are skipped; a document is never empty.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipefisher.core.usage import UsageError
from pipefisher.data.corpus import _is_sentence_per_line, embedded_corpus, split_sentences

EMBEDDED = "embedded"
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_HEAD_BYTES = 1 << 20  # text read to tell the one-sentence-per-line format from prose
Document = list[str]


def _collapse(line: str) -> str:
    return " ".join(line.split())


@dataclass(frozen=True)
class TextFile:
    """A text file: `per_line` True for one sentence per line (blank lines between documents),
    False for prose (each paragraph a document, split into sentences)."""

    path: Path
    per_line: bool

    @property
    def kind(self) -> str:
        return "sentences" if self.per_line else "text"

    def documents(self) -> Iterator[Document]:
        block: list[str] = []
        with open(self.path, encoding="utf-8") as file:
            try:
                for line in file:
                    if line.strip():
                        block.append(line)
                        continue
                    yield from self._document(block)
                    block = []
            except UnicodeDecodeError:
                raise UsageError(f"INPUT: {self.path} is not UTF-8 text past its first MiB") from None
        yield from self._document(block)

    def _document(self, block: list[str]) -> Iterator[Document]:
        if self.per_line:
            sentences = [_collapse(line) for line in block]
        else:
            sentences = split_sentences("".join(block))
        if sentences:
            yield sentences


@dataclass(frozen=True)
class JsonLines:
    """A JSON-lines file: one object per non-blank line, its `field` a document's text."""

    path: Path
    field: str
    kind: str = "jsonl"

    def documents(self) -> Iterator[Document]:
        with open(self.path, encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UsageError(f"{self.path}:{number}: not a JSON line ({exc.msg}); give JSON lines") from None
                text = row.get(self.field) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    have = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                    raise UsageError(
                        f"--field: {self.path}:{number} has no text field {self.field!r} (it has {have}); name it with --field"
                    )
                if sentences := split_sentences(text):
                    yield sentences


@dataclass(frozen=True)
class HFDataset:
    """A Hugging Face `datasets` dataset in a local folder, its `field` column a document's text."""

    path: Path
    field: str
    split: str
    kind: str = "datasets"

    def documents(self) -> Iterator[Document]:
        dataset = load_local_dataset(self.path, self.split)
        if self.field not in dataset.column_names:
            raise UsageError(
                f"--field: {self.path} has no column {self.field!r} (it has {', '.join(dataset.column_names)}); "
                f"name it with --field"
            )
        for text in dataset.select_columns([self.field]).iter(batch_size=1000):
            for value in text[self.field]:
                if isinstance(value, str) and (sentences := split_sentences(value)):
                    yield sentences


def load_local_dataset(path: Path, split: str):
    """`split` of the dataset in folder `path`: a `save_to_disk` folder, else what `load_dataset`
    reads from the folder offline. UsageError when `datasets` is missing or nothing loads."""
    try:
        import datasets
    except ImportError:
        raise UsageError(f"{path}: reading a datasets folder needs `datasets`: pip install pipefisher[data]") from None
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        try:
            loaded = datasets.load_dataset(str(path))
        except Exception as exc:  # datasets raises many kinds for a folder it cannot read
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UsageError(f"{path}: not a datasets folder ({first}); give one saved with save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UsageError(f"--split: {path} has no split {split!r} (it has {', '.join(loaded)}); name one")
        return loaded[split]
    return loaded


@dataclass(frozen=True)
class Embedded:
    """The embedded corpus, `repeat` passes; with `shuffle_seed` each pass is in the order of a
    permutation drawn from (shuffle_seed, pass), else in corpus order."""

    repeat: int = 1
    shuffle_seed: int | None = None
    kind: str = EMBEDDED

    def documents(self) -> Iterator[Document]:
        corpus = embedded_corpus()
        for repeat in range(self.repeat):
            order = range(len(corpus))
            if self.shuffle_seed is not None:
                order = np.random.default_rng([self.shuffle_seed, repeat]).permutation(len(corpus)).tolist()
            for index in order:
                yield corpus[index]


Source = TextFile | JsonLines | HFDataset | Embedded


def open_input(spec: str, field: str, split: str, repeat: int, shuffle_seed: int | None) -> Source:
    """The source an INPUT argument names (see the module docstring); UsageError naming it when
    it does not exist or cannot be read."""
    if spec == EMBEDDED:
        return Embedded(repeat, shuffle_seed)
    path = Path(spec)
    if path.is_dir():
        return HFDataset(path, field, split)
    if not path.is_file():
        raise UsageError(
            f"INPUT: {spec} does not exist; give a text or JSON-lines file, a datasets folder or 'embedded'"
        )
    if path.suffix.lower() in JSON_SUFFIXES:
        return JsonLines(path, field)
    try:
        with open(path, "rb") as file:
            raw = file.read(_HEAD_BYTES)
    except OSError as exc:
        raise UsageError(f"INPUT: cannot read {spec}: {exc.strerror}") from None
    try:
        head = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(raw) - 4:  # not a character cut at the end of the head
            raise UsageError(f"INPUT: {spec} is not UTF-8 text (byte {exc.start})") from None
        head = raw[: exc.start].decode("utf-8")
    return TextFile(path, _is_sentence_per_line(head))


def describe(source: Source) -> dict[str, object]:
    """What the manifest records of one input."""
    if isinstance(source, Embedded):
        return {"kind": source.kind, "repeat": source.repeat, "shuffle_seed": source.shuffle_seed}
    described: dict[str, object] = {"kind": source.kind, "path": str(source.path)}
    if isinstance(source, (JsonLines, HFDataset)):
        described["field"] = source.field
    return described


def all_documents(sources: list[Source]) -> Iterator[Document]:
    """The documents of every source, in order."""
    for source in sources:
        yield from source.documents()


def distinct_documents(sources: list[Source]) -> Iterator[Document]:
    """`all_documents` with one pass over `embedded` in corpus order: what a tokenizer trains on
    (repeats teach it nothing)."""
    for source in sources:
        yield from (Embedded() if isinstance(source, Embedded) else source).documents()
