"""Gradients that differ only in their rounding, as one process and a pipeline's replicas sum the
same micro-batches in other orders (pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch


def sums_in_two_orders(
    rows: int, cols: int, seed: int = 5, parts: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sum of `parts` random ``(rows, cols)`` parts taken in sequence and by halves (their
    last bits differ: asserted), and a following gradient of that shape."""
    gen = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(rows, cols, generator=gen) for _ in range(parts)]
    half = parts // 2
    in_sequence = sum(pieces[1:], pieces[0].clone())
    by_halves = sum(pieces[1:half], pieces[0].clone()) + sum(pieces[half + 1 :], pieces[half].clone())
    assert not torch.equal(in_sequence, by_halves), "the two orders round differently"
    return in_sequence, by_halves, torch.randn(rows, cols, generator=gen)
