"""Causal-LM micro-batches from a memory-mapped shard split: the tensors `CausalLMData` gives, read
in a seeded order by global sample index.

The split's documents are packed as one stream, each document's tokens followed by the
end-of-text id, cut into sequences of `seq_len` tokens (the tail that fills no sequence is
dropped). The stream is never built: packed sequence i is gathered from the mapped tokens
through the documents' packed offsets (a search over D + 1 int64s). Sample g is packed sequence
`SampleOrder(N, seed)(g)` (`pipefisher.data.shards.order`).
"""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Tokenizer

from pipefisher.data.shards.format import ShardSplit
from pipefisher.data.shards.order import SampleOrder, sample_ids
from pipefisher.data.tokenizer import end_of_text_id


class ShardCausalData:
    """Packed next-token-prediction micro-batches over `split`, ids from `tokenizer` (its
    end-of-text id goes between documents). A step reads `step_micro_batches` micro-batches
    of `micro_batch_size` sequences over all replicas."""

    def __init__(
        self,
        split: ShardSplit,
        tokenizer: Tokenizer,
        seq_len: int,
        micro_batch_size: int,
        step_micro_batches: int,
        seed: int,
    ):
        if seq_len < 2 or micro_batch_size < 1 or step_micro_batches < 1 or seed < 0:
            raise ValueError(
                "need seq_len >= 2, micro_batch_size >= 1, step_micro_batches >= 1 and seed >= 0, got "
                f"{seq_len}, {micro_batch_size}, {step_micro_batches}, {seed}"
            )
        self.tokenizer, self.split = tokenizer, split
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.step_micro_batches = step_micro_batches
        self.end_of_text = end_of_text_id(tokenizer)
        token_starts = np.asarray(split.sentence_starts[np.asarray(split.document_starts)], dtype=np.int64)
        self._token_starts = token_starts[:-1]
        self._lengths = np.diff(token_starts)
        #: where each document starts in the packed stream, and the stream's end (D + 1 entries)
        self._packed_starts = np.concatenate([[0], np.cumsum(self._lengths + 1)]).astype(np.int64)
        self.num_sequences = int(self._packed_starts[-1]) // seq_len
        if self.num_sequences < 1:
            raise ValueError(
                f"the split packs {int(self._packed_starts[-1])} tokens, fewer than one sequence of seq_len {seq_len}"
            )
        self.order = SampleOrder(self.num_sequences, seed)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def sequences(self, indices: np.ndarray) -> np.ndarray:
        """Packed sequences `indices` (each in [0, num_sequences)) as (len(indices), seq_len) int64."""
        positions = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len + np.arange(self.seq_len)
        document = np.searchsorted(self._packed_starts, positions, side="right") - 1
        offset = positions - self._packed_starts[document]
        length = self._lengths[document]
        inside = offset < length
        ids = np.full(positions.shape, self.end_of_text, dtype=np.int64)
        ids[inside] = self.split.tokens[self._token_starts[document[inside]] + offset[inside]]
        return ids

    def samples(self, step: int, micro_batch: int) -> np.ndarray:
        """The global sample indices of global micro-batch `micro_batch` of `step` (`sample_ids`)."""
        return sample_ids(step, micro_batch, self.micro_batch_size, self.step_micro_batches)

    def micro_batch(self, step: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """Global micro-batch `micro_batch` of `step` (both >= 0): CPU int64 tensors (B, T), B =
        micro_batch_size, T = seq_len: input_ids and labels (= input_ids), as `CausalLMData`'s."""
        input_ids = torch.from_numpy(self.sequences(self.order(self.samples(step, micro_batch))))
        return {"input_ids": input_ids, "labels": input_ids.clone()}
