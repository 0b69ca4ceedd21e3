"""Causal language-model micro-batches (next-token prediction), a pure function of (seed, step,
micro-batch id), as Hugging Face's `run_clm` packs text.

The corpus is tokenized once, every document followed by the end-of-text token, all of it
concatenated and cut into sequences of `seq_len` tokens (the tail that fills no sequence is
dropped). A micro-batch is `micro_batch_size` of those sequences drawn uniformly, with
replacement, from a generator seeded by (seed, step, micro-batch): every process rebuilds any
micro-batch on its own. Labels are the inputs themselves; the model shifts them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from pipefisher.data.corpus import corpus_fingerprint, write_once
from pipefisher.data.tokenizer import end_of_text_id

BATCH_KEYS: tuple[str, ...] = ("input_ids", "labels")
_TOKENS_RECIPE = "causal-documents-v1"  # part of the token cache key: change it when tokenization changes


def tokenize_documents(
    documents: list[list[str]], tokenizer: Tokenizer, cache_dir: str | Path | None = None
) -> np.ndarray:
    """Token ids (int32) of the documents, each followed by the end-of-text id (sentences joined by
    spaces, no other special tokens); cached in `cache_dir` as .npy keyed by corpus and tokenizer."""
    path = None
    if cache_dir is not None:
        key = f"{_TOKENS_RECIPE}|{corpus_fingerprint(documents)}|{hashlib.sha256(tokenizer.to_str().encode()).hexdigest()}"
        path = Path(cache_dir) / f"causal-tokens-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npy"
        if path.is_file():
            return np.load(path)
    end = end_of_text_id(tokenizer)
    encodings = tokenizer.encode_batch([" ".join(document) for document in documents], add_special_tokens=False)
    tokens = np.fromiter((i for encoding in encodings for i in (*encoding.ids, end)), dtype=np.int32)
    if path is not None:
        write_once(path, lambda partial: _save(partial, tokens))
    return tokens


def _save(path: Path, tokens: np.ndarray) -> None:
    with open(path, "wb") as file:
        np.save(file, tokens)


class CausalLMData:
    """Packed next-token-prediction micro-batches over `documents` tokenized by `tokenizer`.

    `micro_batch(step, micro_batch)` is a pure function of (seed, step, micro_batch). Data-parallel
    sharding is the caller's, as for `PretrainingData`.
    """

    def __init__(
        self,
        documents: list[list[str]],
        tokenizer: Tokenizer,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        cache_dir: str | Path | None = None,
    ):
        if seq_len < 2 or micro_batch_size < 1 or seed < 0:
            raise ValueError(
                f"need seq_len >= 2, micro_batch_size >= 1 and seed >= 0, got {seq_len}, {micro_batch_size}, {seed}"
            )
        self.tokenizer = tokenizer
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.end_of_text = end_of_text_id(tokenizer)
        tokens = tokenize_documents(documents, tokenizer, cache_dir)
        count = len(tokens) // seq_len
        if count < 1:
            raise ValueError(f"the corpus holds {len(tokens)} tokens, fewer than one sequence of seq_len {seq_len}")
        self.sequences = tokens[: count * seq_len].reshape(count, seq_len)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def micro_batch(self, step: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """Global micro-batch `micro_batch` of `step` (both >= 0): CPU int64 tensors (B, T) with B =
        micro_batch_size, T = seq_len: input_ids and labels (= input_ids). No attention_mask:
        sequences are packed, never padded, so a model attends causally without a mask."""
        if step < 0 or micro_batch < 0:
            raise ValueError(f"step and micro_batch must be >= 0, got {step} and {micro_batch}")
        rows = np.random.default_rng([self.seed, step, micro_batch]).integers(
            len(self.sequences), size=self.micro_batch_size
        )
        input_ids = torch.from_numpy(self.sequences[rows].astype(np.int64))
        return {"input_ids": input_ids, "labels": input_ids.clone()}
