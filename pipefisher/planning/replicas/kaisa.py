"""KAISA's gradient workers (Pauloski et al., SC'21) over the replicas of a pipeline stage. Pure
Python: no torch.

A stage has R replicas (its pipes x the data-parallel copies). With grad-worker fraction f, each
K-FAC layer has G = f·R *gradient workers*: they keep the layer's inverses and precondition its
reduced gradient; every other replica receives the preconditioned gradient from one of them. The
replicas, in ascending rank order, form a grid of G blocks of R/G: position i is in block
i // (R/G) and worker group i % (R/G); layer number l (in the stage's layer order) belongs to
worker group l % (R/G), whose member in each block broadcasts the layer's preconditioned
gradient to that block. f = 1 (G = R): every replica is a worker (communication-optimal, no
broadcast); f = 1/R: one worker per layer broadcasts to all (memory-optimal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def worker_count(replicas: int, fraction: float) -> int:
    """G = fraction · replicas; ValueError naming the usable fractions unless it is a whole
    divisor of `replicas`."""
    workers = round(fraction * replicas)
    if workers < 1 or abs(workers - fraction * replicas) > 1e-9 or replicas % workers:
        usable = ", ".join(f"{d / replicas:g}" for d in range(1, replicas + 1) if replicas % d == 0)
        raise ValueError(
            f"{fraction:g} x {replicas} replicas of each stage is not a whole divisor of {replicas}; use {usable}"
        )
    return workers


@dataclass(frozen=True)
class GradWorkers:
    """The gradient-worker grid of one stage: `ranks` (its replicas, ascending) and `workers` (G)."""

    ranks: tuple[int, ...]
    workers: int

    @property
    def block_size(self) -> int:
        """R/G: the replicas one worker serves (itself included)."""
        return len(self.ranks) // self.workers

    def block(self, rank: int) -> int:
        return self.ranks.index(rank) // self.block_size

    def block_ranks(self, block: int) -> tuple[int, ...]:
        size = self.block_size
        return self.ranks[block * size : (block + 1) * size]

    def worker(self, layer: int, block: int) -> int:
        """The rank of block `block` that preconditions and broadcasts layer number `layer`."""
        return self.ranks[block * self.block_size + layer % self.block_size]

    def works_for(self, rank: int, layer: int) -> bool:
        return self.worker(layer, self.block(rank)) == rank

    def layers_of(self, rank: int, count: int) -> list[int]:
        """The layer numbers among `count` that `rank` works for."""
        return [layer for layer in range(count) if self.works_for(rank, layer)]


def grad_workers(ranks: Sequence[int], fraction: float) -> GradWorkers:
    """The grid of a stage whose replicas are `ranks` (any order) for grad-worker `fraction`."""
    ordered = tuple(sorted(ranks))
    return GradWorkers(ordered, worker_count(len(ordered), fraction))
