"""BERT WordPiece tokenizers (`tokenizers` library): trained on a corpus and cached, or loaded
from a BERT `vocab.txt`. Both share BERT's pipeline: lower-casing, accent-stripping normalizer,
whitespace-and-punctuation pre-tokenizer, `##` continuation prefix, `[CLS] A [SEP] B [SEP]`
post-processor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from pipefisher.data.corpus import corpus_fingerprint, write_once

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, CLS, SEP, MASK)
"""In id order for trained tokenizers: [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4."""

_RECIPE = "bert-wordpiece-v1"  # part of the cache key: change it when the training recipe changes


@dataclass(frozen=True)
class SpecialIds:
    """Ids of BERT's special tokens in one tokenizer's vocabulary."""

    pad: int
    unk: int
    cls: int
    sep: int
    mask: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> SpecialIds:
        """The special ids of `tokenizer`; ValueError naming any special token it lacks."""
        ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
        missing = [token for token, index in ids.items() if index is None]
        if missing:
            raise ValueError(f"tokenizer vocabulary lacks special token(s) {', '.join(missing)}")
        return cls(*(ids[token] for token in SPECIAL_TOKENS))

    def as_tuple(self) -> tuple[int, ...]:
        """(pad, unk, cls, sep, mask)."""
        return (self.pad, self.unk, self.cls, self.sep, self.mask)


def _bert_pipeline(model: models.WordPiece, lowercase: bool = True) -> Tokenizer:
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=lowercase, lowercase=lowercase
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def _add_post_processor(tokenizer: Tokenizer) -> Tokenizer:
    special = SpecialIds.from_tokenizer(tokenizer)
    tokenizer.post_processor = processors.BertProcessing((SEP, special.sep), (CLS, special.cls))
    return tokenizer


def wordpiece_cache_path(documents: list[list[str]], vocab_size: int, cache_dir: str | Path) -> Path:
    """Where `train_wordpiece` caches its result: keyed by corpus, vocab size and recipe."""
    key = hashlib.sha256(f"{_RECIPE}|{vocab_size}|{corpus_fingerprint(documents)}".encode()).hexdigest()[:16]
    return Path(cache_dir) / f"wordpiece-{vocab_size}-{key}.json"


def train_wordpiece(documents: list[list[str]], vocab_size: int, cache_dir: str | Path | None = None) -> Tokenizer:
    """A BERT WordPiece tokenizer with at most `vocab_size` tokens trained on the sentences of
    `documents`; special tokens get ids 0-4 (see SPECIAL_TOKENS).

    Training is not bit-reproducible (`tokenizers` breaks merge ties in hash order, issue
    huggingface/tokenizers#1794), so with `cache_dir` the first tokenizer saved there (JSON,
    first writer wins) is the one every later or concurrent call returns: processes that share
    the cache directory share one vocabulary.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    path = None if cache_dir is None else wordpiece_cache_path(documents, vocab_size, cache_dir)
    if path is not None and path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = _bert_pipeline(models.WordPiece(unk_token=UNK))
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), continuing_subword_prefix="##", show_progress=False
    )
    tokenizer.train_from_iterator((sentence for document in documents for sentence in document), trainer)
    _add_post_processor(tokenizer)
    if path is None:
        return tokenizer
    return Tokenizer.from_file(str(write_once(path, lambda partial: tokenizer.save(str(partial)))))


def load_vocab(path: str | Path, lowercase: bool = True) -> Tokenizer:
    """A BERT WordPiece tokenizer from `vocab.txt` (one token per line, id = line number), e.g. a
    released BERT checkpoint's; `lowercase=False` for cased vocabularies. The file must hold the
    five special tokens."""
    vocab = models.WordPiece.read_file(str(path))
    return _add_post_processor(_bert_pipeline(models.WordPiece(vocab, unk_token=UNK), lowercase))
