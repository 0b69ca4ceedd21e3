"""Tokenizers (`tokenizers` library), trained on a corpus and cached, or loaded from a file.

BERT WordPiece (trained, or from a BERT `vocab.txt`): lower-casing, accent-stripping normalizer,
whitespace-and-punctuation pre-tokenizer, `##` continuation prefix, `[CLS] A [SEP] B [SEP]`
post-processor. Byte-level BPE for causal language models (GPT-2's scheme: every byte is a
token, no unknown token, one `<|endoftext|>` special token between documents), trained, or any
`tokenizer.json` holding an end-of-text token.
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
_BPE_RECIPE = "byte-level-bpe-v1"
END_OF_TEXT = "<|endoftext|>"
#: end-of-text tokens `end_of_text_id` recognises, in the order it tries them
END_OF_TEXT_TOKENS: tuple[str, ...] = (END_OF_TEXT, "</s>", "<eos>", "[SEP]")


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
        found = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
        ids = {token: index for token, index in found.items() if index is not None}
        missing = [token for token in SPECIAL_TOKENS if token not in ids]
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
    return _cache_path("wordpiece", _RECIPE, documents, vocab_size, cache_dir)


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

    def train() -> Tokenizer:
        tokenizer = _bert_pipeline(models.WordPiece(unk_token=UNK))
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            continuing_subword_prefix="##",
            show_progress=False,
        )
        tokenizer.train_from_iterator((sentence for document in documents for sentence in document), trainer)
        return _add_post_processor(tokenizer)

    return _cached_training("wordpiece", _RECIPE, documents, vocab_size, cache_dir, train)


def load_vocab(path: str | Path, lowercase: bool = True) -> Tokenizer:
    """A BERT WordPiece tokenizer from `vocab.txt` (one token per line, id = line number), e.g. a
    released BERT checkpoint's; `lowercase=False` for cased vocabularies. The file must hold the
    five special tokens."""
    vocab = models.WordPiece.read_file(str(path))
    return _add_post_processor(_bert_pipeline(models.WordPiece(vocab, unk_token=UNK), lowercase))


def _cache_path(kind: str, recipe: str, documents: list[list[str]], vocab_size: int, cache_dir: str | Path) -> Path:
    key = hashlib.sha256(f"{recipe}|{vocab_size}|{corpus_fingerprint(documents)}".encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{kind}-{vocab_size}-{key}.json"


def _cached_training(
    kind: str, recipe: str, documents: list[list[str]], vocab_size: int, cache_dir: str | Path | None, train
) -> Tokenizer:
    """`train()` once per (corpus, vocab size, recipe) in `cache_dir`: the first tokenizer saved
    there (first writer wins) is the one every later or concurrent call returns."""
    if cache_dir is None:
        return train()
    path = _cache_path(kind, recipe, documents, vocab_size, cache_dir)
    if not path.is_file():
        tokenizer = train()
        write_once(path, lambda partial: tokenizer.save(str(partial)))
    return Tokenizer.from_file(str(path))


def train_byte_level_bpe(documents: list[list[str]], vocab_size: int, cache_dir: str | Path | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer of at most `vocab_size` tokens (at least the 256 bytes and
    END_OF_TEXT, id 0) trained on `documents`, cached in `cache_dir` as `train_wordpiece` is."""
    if vocab_size <= 257:
        raise ValueError(f"vocab_size must exceed the 256 byte tokens and {END_OF_TEXT}, got {vocab_size}")

    def train() -> Tokenizer:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train_from_iterator((" ".join(document) for document in documents), trainer)
        return tokenizer

    return _cached_training("bpe", _BPE_RECIPE, documents, vocab_size, cache_dir, train)


def end_of_text_id(tokenizer: Tokenizer) -> int:
    """Id of the tokenizer's end-of-text token (the first of END_OF_TEXT_TOKENS it has);
    ValueError when it has none."""
    for token in END_OF_TEXT_TOKENS:
        index = tokenizer.token_to_id(token)
        if index is not None:
            return index
    raise ValueError(f"tokenizer has no end-of-text token (one of {', '.join(END_OF_TEXT_TOKENS)})")
