"""How a preconditioned matrix (Shampoo's, SOAP's) is cut into blocks, and the flat layout of its
per-block tensors.

A parameter of shape ``(d0, d1, ...)`` is viewed as the matrix ``(rows, cols) = (d0, d1·...)``.
Rows are cut into chunks of ``block_size`` (the last may be shorter), columns likewise; block
``(i, j)`` is the k-th with ``k = i·J + j`` (row-major over the grid, J column chunks). Factor
"A" holds one ``rows_i × rows_i`` matrix per block, factor "B" one ``cols_j × cols_j``; a flat
tensor of a factor concatenates its blocks' matrices (each row-major) in block order. Pure Python
(memory models read it without torch).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import Tensor

Factor = Literal["A", "B"]
FACTORS: tuple[Factor, Factor] = ("A", "B")


def split_sizes(length: int, block_size: int) -> tuple[int, ...]:
    """Chunk sizes of a dimension of ``length``: ``block_size`` each, the last one the rest."""
    full, rest = divmod(length, block_size)
    return (block_size,) * full + ((rest,) if rest else ())


@dataclass(frozen=True)
class MatrixInfo:
    """A blocked matrix as the planner sees it: parameter ``name``, its matrix ``shape``
    ``(rows, cols)`` and the chunk sizes of its rows and columns (each summing to the dimension)."""

    name: str
    shape: tuple[int, int]
    row_blocks: tuple[int, ...]
    col_blocks: tuple[int, ...]

    @staticmethod
    def of(name: str, shape: tuple[int, ...], block_size: int) -> MatrixInfo:
        """The info of a parameter of ``shape`` (at least 2-D) cut into ``block_size`` blocks."""
        rows, cols = shape[0], math.prod(shape[1:])
        return MatrixInfo(name, (rows, cols), split_sizes(rows, block_size), split_sizes(cols, block_size))

    @property
    def num_blocks(self) -> int:
        return len(self.row_blocks) * len(self.col_blocks)

    @property
    def gradient_numel(self) -> int:
        """Elements of the gradient (``rows · cols``)."""
        return self.shape[0] * self.shape[1]

    def block_sizes(self, factor: Factor) -> tuple[int, ...]:
        """Side of ``factor``'s square matrix of each block, in block order."""
        if factor == "A":
            return tuple(r for r in self.row_blocks for _ in self.col_blocks)
        if factor == "B":
            return tuple(c for _ in self.row_blocks for c in self.col_blocks)
        raise ValueError(f"factor must be 'A' or 'B', got {factor!r}")

    def statistic_numel(self, factor: Factor) -> int:
        """Elements of all of ``factor``'s block matrices (statistics, roots, bases) together."""
        return sum(n * n for n in self.block_sizes(factor))

    def largest_group(self, factor: Factor) -> int:
        """Elements of the largest group of ``factor``'s same-size blocks: what its refresh op
        stacks and decomposes at once (its memory scales with it)."""
        sizes = self.block_sizes(factor)
        return max(n * n * sizes.count(n) for n in set(sizes))

    def grid(self) -> Iterator[tuple[int, slice, slice]]:
        """``(k, row slice, column slice)`` of every block of the ``(rows, cols)`` matrix, in block order."""
        k = 0
        r0 = 0
        for r in self.row_blocks:
            c0 = 0
            for c in self.col_blocks:
                yield k, slice(r0, r0 + r), slice(c0, c0 + c)
                k += 1
                c0 += c
            r0 += r


def block_views(flat: Tensor, sizes: tuple[int, ...]) -> list[Tensor]:
    """``(n, n)`` views into a 1-D ``flat`` tensor of ``Σ n²`` elements, one per size, in order."""
    views = []
    start = 0
    for n in sizes:
        views.append(flat[start : start + n * n].view(n, n))
        start += n * n
    return views


@dataclass(frozen=True)
class Block:
    """Block `k` of the `matrix`-th matrix of a list: its row and column slices."""

    matrix: int
    k: int
    rows: slice
    cols: slice


def block_groups(matrices: Sequence[tuple[MatrixInfo, Hashable]], stacked: bool = True) -> list[list[Block]]:
    """The blocks of `matrices` (each with a key, e.g. its device) grouped by (rows, cols) size
    and key, in order of first appearance, each group in matrix then block order: the blocks
    one batched product can take together. Not `stacked`: every block alone, in that order (a
    CPU's batched products are slower than its one-matrix ones, and launches cost it little)."""
    groups: dict[tuple[int, int, Hashable], list[Block]] = {}
    for number, (info, key) in enumerate(matrices):
        for k, rows, cols in info.grid():
            groups.setdefault((rows.stop - rows.start, cols.stop - cols.start, key), []).append(
                Block(number, k, rows, cols)
            )
    return list(groups.values()) if stacked else [[block] for group in groups.values() for block in group]
