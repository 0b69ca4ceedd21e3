"""BERT pretraining micro-batches (masked LM + next-sentence prediction), a pure function of
(seed, step, micro-batch id), as in Devlin et al. (2019) and Google's create_pretraining_data.py.

Every process builds the same `PretrainingData` from the same corpus and tokenizer and can then
rebuild any micro-batch on its own: pipeline stages, data-parallel replicas and the
single-process reference see identical tensors without exchanging data.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tokenizers import Tokenizer

from pipefisher.data.corpus import corpus_fingerprint, embedded_corpus, write_once
from pipefisher.data.settings import max_predictions
from pipefisher.data.tokenizer import SpecialIds, train_wordpiece
from pipefisher.models.mlm import IGNORE_INDEX


BATCH_KEYS: tuple[str, ...] = (
    "input_ids",
    "token_type_ids",
    "attention_mask",
    "mlm_labels",
    "mlm_positions",
    "nsp_labels",
)

_TOKENS_RECIPE = "sentences-v1"  # part of the token cache key: change it when tokenization changes


@dataclass(frozen=True)
class TokenizedCorpus:
    """Token ids of a corpus without special tokens. Sentence i is
    `tokens[sentence_starts[i]:sentence_starts[i + 1]]` (never empty); document d holds sentences
    `document_starts[d]:document_starts[d + 1]` (at least two). tokens int32, starts int64."""

    tokens: np.ndarray
    sentence_starts: np.ndarray
    document_starts: np.ndarray

    def save(self, path: Path) -> None:
        """Write the three arrays to `path` in .npz format."""
        with open(path, "wb") as file:
            np.savez(
                file, tokens=self.tokens, sentence_starts=self.sentence_starts, document_starts=self.document_starts
            )

    @property
    def num_documents(self) -> int:
        return len(self.document_starts) - 1

    @property
    def num_sentences(self) -> int:
        return len(self.sentence_starts) - 1


def tokenize_corpus(
    documents: list[list[str]], tokenizer: Tokenizer, cache_dir: str | Path | None = None
) -> TokenizedCorpus:
    """Every sentence of `documents` encoded once (batch encode, no special tokens added; any
    [PAD]/[CLS]/[SEP]/[MASK] produced by the text itself removed). Sentences left empty and then
    documents with fewer than two sentences are dropped. With `cache_dir`, the result is cached
    there as .npz keyed by corpus and tokenizer."""
    path = None
    if cache_dir is not None:
        key = f"{_TOKENS_RECIPE}|{corpus_fingerprint(documents)}|{hashlib.sha256(tokenizer.to_str().encode()).hexdigest()}"
        path = Path(cache_dir) / f"tokens-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
        if path.is_file():
            with np.load(path) as cached:
                return TokenizedCorpus(cached["tokens"], cached["sentence_starts"], cached["document_starts"])
    special = SpecialIds.from_tokenizer(tokenizer)
    sentences = [sentence for document in documents for sentence in document]
    ids = [encoding.ids for encoding in tokenizer.encode_batch(sentences, add_special_tokens=False)]
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32)
    sentence_of_token = np.repeat(np.arange(len(ids)), [len(sentence) for sentence in ids])
    keep_token = ~np.isin(tokens, [special.pad, special.cls, special.sep, special.mask])
    tokens, lengths = tokens[keep_token], np.bincount(sentence_of_token[keep_token], minlength=len(ids))
    document_of_sentence = np.repeat(np.arange(len(documents)), [len(document) for document in documents])
    sentence_counts = np.bincount(document_of_sentence[lengths > 0], minlength=len(documents))
    keep_sentence = (lengths > 0) & (sentence_counts >= 2)[document_of_sentence]
    corpus = TokenizedCorpus(
        tokens=tokens[np.repeat(keep_sentence, lengths)],
        sentence_starts=np.concatenate([[0], np.cumsum(lengths[keep_sentence])]).astype(np.int64),
        document_starts=np.concatenate([[0], np.cumsum(sentence_counts[sentence_counts >= 2])]).astype(np.int64),
    )
    if path is not None:
        write_once(path, corpus.save)
    return corpus


def _truncate_pair(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths after BERT's truncation (while too long, drop a token of the longer segment, of B
    on a tie), in closed form."""
    if len_a + len_b <= budget:
        return len_a, len_b
    cap_a, cap_b = (budget + 1) // 2, budget // 2
    if len_a <= cap_a:
        return len_a, budget - len_a
    if len_b <= cap_b:
        return budget - len_b, len_b
    return cap_a, cap_b


class Corpus(Protocol):
    """Token ids laid out as `TokenizedCorpus` (or a memory-mapped `ShardSplit`) lays them out
    (read only)."""

    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def sentence_starts(self) -> np.ndarray: ...

    @property
    def document_starts(self) -> np.ndarray: ...


class SentencePairs:
    """BERT's example builder over a `corpus` (in memory or memory-mapped): sentence-pair examples
    with masking, each a function of a generator and a candidate index alone.

    Candidates are the sentences that have a successor in their document (so documents of one
    sentence add none), numbered in corpus order; candidate c's sentence is found by a search
    over the document starts, so no array proportional to the sentences is held.
    """

    def __init__(self, corpus: Corpus, special: SpecialIds, vocab_size: int, seq_len: int, mask_prob: float):
        if seq_len < 5:
            raise ValueError(f"seq_len must be at least 5 ([CLS] a [SEP] b [SEP]), got {seq_len}")
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
        self.corpus, self.special, self.seq_len, self.mask_prob = corpus, special, seq_len, mask_prob
        self.num_documents = len(corpus.document_starts) - 1
        document_starts = np.asarray(corpus.document_starts, dtype=np.int64)
        #: candidates before document d: each document's sentences but its last
        self._candidate_starts = document_starts - np.arange(self.num_documents + 1)
        self.num_candidates = int(self._candidate_starts[-1]) if self.num_documents else 0
        if self.num_documents < 2 or self.num_candidates < 1:
            raise ValueError(
                f"need at least 2 documents, one of 2+ sentences, for next-sentence prediction; got {self.num_documents} "
                f"documents with {self.num_candidates} sentence(s) that have a successor"
            )
        self._document_starts = document_starts
        self._random_ids = np.setdiff1d(np.arange(vocab_size), special.as_tuple())

    @property
    def max_predictions(self) -> int:
        """P, the most labelled positions an example can have: the width of `mlm_positions`
        (NVIDIA's max_predictions_per_seq), a function of seq_len and mask_prob alone."""
        return max_predictions(self.seq_len, self.mask_prob)

    def first_sentence(self, candidate: int) -> tuple[int, int]:
        """(sentence, document) of candidate `candidate` (0 <= candidate < num_candidates)."""
        document = int(np.searchsorted(self._candidate_starts, candidate, side="right")) - 1
        return int(self._document_starts[document]) + candidate - int(self._candidate_starts[document]), document

    def stack(self, examples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        """Examples as one micro-batch of CPU tensors; attention_mask left out when no example is padded."""
        stacked = {key: np.stack([example[key] for example in examples]) for key in BATCH_KEYS}
        if stacked["attention_mask"].all():
            del stacked["attention_mask"]
        return {key: torch.from_numpy(value) for key, value in stacked.items()}

    def example(self, rng: np.random.Generator, candidate: int) -> dict[str, np.ndarray]:
        """The example whose segment A starts at candidate `candidate`, its other choices drawn from
        `rng`; arrays (seq_len,) int64, nsp_labels 0-d. `[CLS] A [SEP] B [SEP] [PAD]…`: A is one or
        more consecutive sentences of a document; B the sentences that follow (nsp_labels 0) or,
        with probability 1/2, a run of another document (1); trimmed to seq_len by BERT's rule (A
        loses tokens at its start, B at its end). token_type_ids: 0 up to the first [SEP], 1 on B
        and its [SEP], 0 on padding. Of the A and B positions, round(mask_prob·n) (at least 1) get
        mlm_labels = original id, and of those 80 % become [MASK], 10 % a random non-special id,
        10 % stay. mlm_positions (max_predictions,): the labelled positions in increasing order,
        then 0 ([CLS], never labelled) up to the width."""
        corpus, budget, document_starts = self.corpus, self.seq_len - 3, self._document_starts
        starts, tokens = corpus.sentence_starts, corpus.tokens

        first, document = self.first_sentence(candidate)
        document_end = int(document_starts[document + 1])
        end = first + 2
        while end < document_end and starts[end] - starts[first] < budget:
            end += 1
        split = int(rng.integers(first + 1, end))
        is_random = bool(rng.random() < 0.5)
        segment_a = tokens[starts[first] : starts[split]]
        if is_random:
            other = int(rng.integers(self.num_documents - 1))
            other += other >= document
            other_first = int(rng.integers(document_starts[other], document_starts[other + 1]))
            b_from = starts[other_first]
            segment_b = tokens[b_from : min(starts[document_starts[other + 1]], b_from + budget)]
        else:
            segment_b = tokens[starts[split] : starts[end]]
        len_a, len_b = _truncate_pair(len(segment_a), len(segment_b), budget)
        segment_a, segment_b = segment_a[len(segment_a) - len_a :], segment_b[:len_b]

        special, length = self.special, len_a + len_b + 3
        input_ids = np.full(self.seq_len, special.pad, dtype=np.int64)
        input_ids[:length] = np.concatenate([[special.cls], segment_a, [special.sep], segment_b, [special.sep]])
        token_type_ids = np.zeros(self.seq_len, dtype=np.int64)
        token_type_ids[len_a + 2 : length] = 1
        attention_mask = np.zeros(self.seq_len, dtype=np.int64)
        attention_mask[:length] = 1

        candidates = np.concatenate([np.arange(1, len_a + 1), np.arange(len_a + 2, len_a + 2 + len_b)])
        num_masked = min(len(candidates), max(1, round(self.mask_prob * len(candidates))))
        positions = rng.choice(candidates, size=num_masked, replace=False)
        mlm_labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        mlm_labels[positions] = input_ids[positions]
        mlm_positions = np.zeros(self.max_predictions, dtype=np.int64)
        mlm_positions[:num_masked] = np.sort(positions)
        action = rng.random(num_masked)
        random_ids = self._random_ids[rng.integers(len(self._random_ids), size=num_masked)]
        input_ids[positions] = np.where(
            action < 0.8, special.mask, np.where(action < 0.9, random_ids, input_ids[positions])
        )
        return {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "attention_mask": attention_mask,
            "mlm_labels": mlm_labels,
            "mlm_positions": mlm_positions,
            "nsp_labels": np.array(is_random, dtype=np.int64),
        }


class PretrainingData:
    """BERT pretraining micro-batches over `documents` tokenized by `tokenizer`.

    `micro_batch(step, micro_batch)` is a pure function of (seed, step, micro_batch): the same
    arguments give the same tensors in any process and in any call order. Data-parallel
    sharding is the caller's: give every replica disjoint global micro-batch ids (e.g. replica
    r of R uses ids r·M … r·M + M − 1 for its M micro-batches of a step).
    """

    def __init__(
        self,
        documents: list[list[str]],
        tokenizer: Tokenizer,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        mask_prob: float = 0.15,
        cache_dir: str | Path | None = None,
    ):
        if micro_batch_size < 1 or seed < 0:
            raise ValueError(f"need micro_batch_size >= 1 and seed >= 0, got {micro_batch_size} and {seed}")
        self.tokenizer = tokenizer
        self.seq_len, self.micro_batch_size, self.seed, self.mask_prob = seq_len, micro_batch_size, seed, mask_prob
        self.corpus = tokenize_corpus(documents, tokenizer, cache_dir)
        self._special = SpecialIds.from_tokenizer(tokenizer)
        self.pairs = SentencePairs(self.corpus, self._special, self.vocab_size, seq_len, mask_prob)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def special(self) -> SpecialIds:
        return self._special

    @property
    def max_predictions(self) -> int:
        """P, the width of `mlm_positions` (`SentencePairs.max_predictions`)."""
        return self.pairs.max_predictions

    def micro_batch(self, step: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """Global micro-batch `micro_batch` of `step` (both >= 0), CPU tensors, B =
        micro_batch_size, T = seq_len, P = max_predictions: input_ids, token_type_ids,
        attention_mask, mlm_labels (B, T) int64, mlm_positions (B, P) int64 and nsp_labels (B,)
        int64; layout in `SentencePairs.example`. attention_mask is left out when no example is
        padded: the model then attends without a mask (SDPA's fused kernels), decided here on the host."""
        if step < 0 or micro_batch < 0:
            raise ValueError(f"step and micro_batch must be >= 0, got {step} and {micro_batch}")
        return self.pairs.stack([self.example(step, micro_batch, index) for index in range(self.micro_batch_size)])

    def example(self, step: int, micro_batch: int, index: int) -> dict[str, np.ndarray]:
        """Example `index` of the micro-batch, from a generator seeded by (seed, step, micro_batch,
        index): its first draw picks the candidate sentence A starts at, the rest
        `SentencePairs.example`'s choices."""
        rng = np.random.default_rng([self.seed, step, micro_batch, index])
        return self.pairs.example(rng, int(rng.integers(self.pairs.num_candidates)))


def default_cache_dir() -> Path:
    """$PIPEFISHER_CACHE if set, else ~/.cache/pipefisher."""
    return Path(os.environ.get("PIPEFISHER_CACHE") or Path.home() / ".cache" / "pipefisher")


def embedded_pretraining_data(
    seq_len: int, micro_batch_size: int, seed: int, vocab_size: int = 4000, cache_dir: str | Path | None = None
) -> PretrainingData:
    """The demo data: `embedded_corpus()` with a WordPiece vocabulary of `vocab_size` trained on
    it; tokenizer and token ids cached in `cache_dir` (default `default_cache_dir()`)."""
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    documents = embedded_corpus(cache_dir)
    tokenizer = train_wordpiece(documents, vocab_size, cache_dir)
    return PretrainingData(documents, tokenizer, seq_len, micro_batch_size, seed, cache_dir=cache_dir)
