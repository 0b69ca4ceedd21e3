"""The tokenizer `pipefisher data prepare --tokenizer` names, resolved once in the parent process
into a picklable `ResolvedTokenizer` that each worker turns into an `Encoder`.

Spellings: `wordpiece` / `bpe` train the project's tokenizer (`data.tokenizer`) on a bounded
sample of the inputs (the first documents up to `SAMPLE_CHARS` characters); a path to a
`tokenizers` JSON file; a folder holding `tokenizer.json`, or any folder or name that
`transformers.AutoTokenizer` loads (a name needs the network or the Hugging Face cache);
`tiktoken:ENCODING` when `tiktoken` is installed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipefisher.core.usage import UsageError
from pipefisher.data.shards.format import TOKENIZER_FILE

TRAINED = ("wordpiece", "bpe")
SAMPLE_CHARS = 16 << 20  # characters of the inputs a tokenizer is trained on, at most
_KEPT_SPECIAL = ("[UNK]", "<unk>")  # special tokens that stand for text: kept in the stored ids


@dataclass(frozen=True)
class ResolvedTokenizer:
    """How ids are made. `json`: the `tokenizers` serialisation (saved as tokenizer.json; None
    for tiktoken); `strip_ids`: special ids removed from every encoding (readers add their own);
    `sha256`: of `json`, or of the tiktoken encoding's name and size."""

    kind: str
    source: str
    vocab_size: int
    sha256: str
    json: str | None = None
    strip_ids: tuple[int, ...] = ()

    def manifest_entry(self) -> dict[str, str]:
        return {"kind": self.kind, "source": self.source, "vocab_size": str(self.vocab_size), "sha256": self.sha256}


class Encoder:
    """Batch encoding without special tokens: texts -> their id lists (built in a worker)."""

    def __init__(self, resolved: ResolvedTokenizer):
        if resolved.json is None:
            import tiktoken

            self._tiktoken = tiktoken.get_encoding(resolved.source)
            self._tokenizer = None
        else:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(resolved.json)

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if self._tokenizer is None:
            return self._tiktoken.encode_ordinary_batch(texts)
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]


def _from_tokenizer(tokenizer, kind: str, source: str) -> ResolvedTokenizer:
    text = tokenizer.to_str()
    strip = sorted(
        index
        for index, token in tokenizer.get_added_tokens_decoder().items()
        if token.special and token.content not in _KEPT_SPECIAL
    )
    return ResolvedTokenizer(
        kind=kind,
        source=source,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        json=text,
        strip_ids=tuple(strip),
    )


def bounded_sample(documents: Iterable[list[str]], max_chars: int = SAMPLE_CHARS) -> list[list[str]]:
    """The first documents of `documents` holding at most `max_chars` characters (at least one)."""
    sample: list[list[str]] = []
    chars = 0
    for document in documents:
        chars += sum(len(sentence) for sentence in document)
        if sample and chars > max_chars:
            break
        sample.append(document)
    return sample


def resolve(spec: str, vocab_size: int, documents: Iterator[list[str]] | None = None) -> ResolvedTokenizer:
    """The tokenizer `spec` names; `documents` (the inputs, read only as far as the sample goes)
    train it for `wordpiece` / `bpe`. UsageError naming --tokenizer or --vocab-size otherwise."""
    if spec in TRAINED:
        return _train(spec, vocab_size, documents or iter(()))
    if spec.startswith("tiktoken:"):
        return _tiktoken(spec.removeprefix("tiktoken:"))
    path = Path(spec)
    if path.is_file() or (path.is_dir() and (path / TOKENIZER_FILE).is_file()):
        file = path if path.is_file() else path / TOKENIZER_FILE
        from tokenizers import Tokenizer

        try:
            return _from_tokenizer(Tokenizer.from_file(str(file)), "file", str(file))
        except Exception as exc:  # tokenizers raises its own exception types for a malformed file
            raise UsageError(f"--tokenizer: {file} is not a tokenizers JSON file ({str(exc)[:80]})") from None
    return _hugging_face(spec)


def _train(kind: str, vocab_size: int, documents: Iterator[list[str]]) -> ResolvedTokenizer:
    from pipefisher.data.tokenizer import train_byte_level_bpe, train_wordpiece

    sample = bounded_sample(documents)
    if not sample:
        raise UsageError("INPUT: the inputs hold no document with a sentence to train the tokenizer on")
    chars = sum(len(sentence) for document in sample for sentence in document)
    train = train_wordpiece if kind == "wordpiece" else train_byte_level_bpe
    try:
        tokenizer = train(sample, vocab_size)
    except ValueError as exc:
        raise UsageError(f"--vocab-size: {exc}") from None
    return _from_tokenizer(
        tokenizer, kind, f"trained on the first {len(sample)} documents ({chars / 2**20:.1f} MiB of text) of the inputs"
    )


def _hugging_face(spec: str) -> ResolvedTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(
            f"--tokenizer {spec}: not a file, and a Hugging Face tokenizer needs `transformers`: pip install pipefisher[hf]"
        ) from None
    try:
        loaded = AutoTokenizer.from_pretrained(spec, use_fast=True)
    except Exception as exc:  # network, missing repository, unreadable folder: all one line for the user
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        raise UsageError(
            f"--tokenizer {spec}: not a tokenizers file, 'wordpiece', 'bpe' or a loadable Hugging Face tokenizer "
            f"({first}); give a local folder when offline"
        ) from None
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None:
        raise UsageError(f"--tokenizer {spec}: has no fast (tokenizers) form; give a tokenizer.json")
    return _from_tokenizer(backend, "hf", spec)


def _tiktoken(encoding: str) -> ResolvedTokenizer:
    try:
        import tiktoken
    except ImportError:
        raise UsageError(f"--tokenizer tiktoken:{encoding}: tiktoken is not installed: pip install tiktoken") from None
    try:
        loaded = tiktoken.get_encoding(encoding)
    except Exception as exc:  # unknown name, or its file cannot be fetched offline
        raise UsageError(f"--tokenizer tiktoken:{encoding}: cannot load it ({str(exc)[:80]})") from None
    digest = hashlib.sha256(f"tiktoken|{encoding}|{loaded.n_vocab}".encode()).hexdigest()
    return ResolvedTokenizer("tiktoken", encoding, loaded.n_vocab, digest)
