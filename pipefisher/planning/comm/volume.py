"""How many bytes a rank sends for a collective, under ring algorithms (NCCL's bandwidth model;
what `grad_comm_bytes` reports and the memory/traffic tables use). Pure Python: no torch."""

from __future__ import annotations


def ring_bytes(kind: str, size: int, members: int) -> int:
    """Bytes each of `members` ranks sends for a collective over `size` bytes: an ``all_reduce``
    2(R−1)/R of them; a ``reduce`` or ``broadcast`` (the parts of a reduce-scatter or all-gather
    to or from each part's owner) (R−1)/R, averaged over the ranks."""
    if kind not in ("all_reduce", "reduce", "broadcast"):
        raise ValueError(f"kind: {kind!r} is not all_reduce, reduce or broadcast")
    share = (members - 1) * size // members
    return 2 * share if kind == "all_reduce" else share


def powersgd_elements(shape: tuple[int, ...], rank: int) -> int:
    """Elements rank-`rank` PowerSGD all-reduces for a gradient of `shape`: R(n + m) for one of
    >= 2 dimensions viewed as n rows x m (the rest) when that is fewer than nm, else all of them
    (vectors, matrices too small to shrink; rank 0 = no compression)."""
    numel = 1
    for size in shape:
        numel *= size
    if rank < 1 or len(shape) < 2 or numel == 0:
        return numel
    rows = shape[0]
    rest = numel // rows
    return rank * (rows + rest) if rank * (rows + rest) < numel else numel
