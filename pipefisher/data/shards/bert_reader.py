"""BERT pretraining micro-batches (masked LM + next-sentence prediction) from a memory-mapped shard
split: the tensors `PretrainingData` gives, built by its example builder (`SentencePairs`) over
the mapped arrays, read in a seeded order by global sample index.

The samples of an epoch are the split's candidate first sentences (those with a successor in
their document: documents of 2+ sentences), each once, in the order `SampleOrder(N, seed)`
(`pipefisher.data.shards.order`); sample g's other choices (where A ends, whether B is random,
the masking) come from a generator seeded by (seed, g).
"""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Tokenizer

from pipefisher.data.pretraining import SentencePairs
from pipefisher.data.shards.format import ShardSplit
from pipefisher.data.shards.order import SampleOrder, sample_ids
from pipefisher.data.tokenizer import SpecialIds


class ShardPretrainingData:
    """BERT pretraining micro-batches over `split`, ids from `tokenizer` (which must hold [PAD],
    [UNK], [CLS], [SEP] and [MASK]: ValueError naming those it lacks). A step reads
    `step_micro_batches` micro-batches of `micro_batch_size` examples over all replicas."""

    def __init__(
        self,
        split: ShardSplit,
        tokenizer: Tokenizer,
        seq_len: int,
        micro_batch_size: int,
        step_micro_batches: int,
        seed: int,
        mask_prob: float = 0.15,
    ):
        if micro_batch_size < 1 or step_micro_batches < 1 or seed < 0:
            raise ValueError(
                "need micro_batch_size >= 1, step_micro_batches >= 1 and seed >= 0, got "
                f"{micro_batch_size}, {step_micro_batches}, {seed}"
            )
        self.tokenizer = tokenizer
        self.seq_len, self.micro_batch_size, self.seed, self.mask_prob = seq_len, micro_batch_size, seed, mask_prob
        self.step_micro_batches = step_micro_batches
        self.special = SpecialIds.from_tokenizer(tokenizer)
        self.pairs = SentencePairs(split, self.special, self.vocab_size, seq_len, mask_prob)
        self.order = SampleOrder(self.pairs.num_candidates, seed)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def max_predictions(self) -> int:
        return self.pairs.max_predictions

    def samples(self, step: int, micro_batch: int) -> np.ndarray:
        """The global sample indices of global micro-batch `micro_batch` of `step` (`sample_ids`)."""
        return sample_ids(step, micro_batch, self.micro_batch_size, self.step_micro_batches)

    def micro_batch(self, step: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """Global micro-batch `micro_batch` of `step` (both >= 0): the keys, dtypes and shapes of
        `PretrainingData.micro_batch` (attention_mask left out when nothing is padded)."""
        samples = self.samples(step, micro_batch)
        candidates = self.order(samples)
        return self.pairs.stack(
            [
                self.pairs.example(np.random.default_rng([self.seed, int(sample)]), int(candidate))
                for sample, candidate in zip(samples, candidates)
            ]
        )
