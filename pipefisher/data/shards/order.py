"""The order a run reads a split's sequences in: sample g (a global index, the same on every
layout) is sequence `order(g)`. Epoch e = g // N reads each of the N sequences once, in the order
of a bijection of [0, N) seeded by (seed, e). Pure numpy.

The bijection is a 4-round Feistel network over the smallest even number of bits that holds N,
walked until it lands inside [0, N) (cycle walking: the domain is under 4 N, so under 4 rounds of
walking on average). A lookup costs O(1) memory: no permutation of N entries is ever built.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_MIX_1, _MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective scramble of uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX_1
    x = (x ^ (x >> np.uint64(27))) * _MIX_2
    return x ^ (x >> np.uint64(31))


class SampleOrder:
    """Sample -> sequence for `count` sequences, seeded by `seed`: a bijection on each epoch's
    samples [e·count, (e + 1)·count)."""

    def __init__(self, count: int, seed: int):
        if count < 1 or seed < 0:
            raise ValueError(f"need count >= 1 and seed >= 0, got {count} and {seed}")
        self.count, self.seed = count, seed
        self._half = max(1, ((count - 1).bit_length() + 1) // 2)  # bits of each Feistel half
        self._mask = np.uint64((1 << self._half) - 1)

    def __call__(self, samples: np.ndarray | int) -> np.ndarray:
        """The sequence index (int64, in [0, count)) of each sample (int >= 0), shape kept."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and samples.min() < 0:
            raise ValueError(f"samples must be >= 0, got {int(samples.min())}")
        epochs, positions = np.divmod(samples, self.count)
        result = np.empty_like(positions)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            result[chosen] = self._permute(positions[chosen], int(epoch))
        return result

    def _permute(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        keys = np.random.SeedSequence([self.seed, epoch]).generate_state(_ROUNDS, np.uint64)
        values = positions.astype(np.uint64)
        pending = np.ones(len(values), dtype=bool)
        while pending.any():
            values[pending] = self._feistel(values[pending], keys)
            pending = values >= np.uint64(self.count)
        return values.astype(np.int64)

    def _feistel(self, values: np.ndarray, keys: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self._half), self._mask
        left, right = values >> half, values & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << half) | right


def sample_ids(step: int, micro_batch: int, micro_batch_size: int, step_micro_batches: int) -> np.ndarray:
    """The global sample indices (int64, (micro_batch_size,)) of global micro-batch `micro_batch` of
    `step`: the samples of the steps before, then micro_batch · micro_batch_size + row. A step
    reads `step_micro_batches` micro-batches over all replicas, so the indices do not depend on
    how those are laid out (stages, schedule, data parallelism)."""
    if step < 0 or micro_batch < 0:
        raise ValueError(f"step and micro_batch must be >= 0, got {step} and {micro_batch}")
    first = (step * step_micro_batches + micro_batch) * micro_batch_size
    return np.arange(first, first + micro_batch_size, dtype=np.int64)
