"""A step's timeline: every op's interval per rank, each rank's end of step, and the bubbles
between (what `pipefisher.planning.simulate` computes and the packer fills). Pure Python."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from typing import Any

from pipefisher.core.ir import Op


@dataclass(frozen=True, slots=True)
class Interval:
    """`op` runs on its rank from `start` to `end` (profile time unit)."""

    op: Op
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @classmethod
    def many(cls, ops: Iterable[Op], starts: Iterable[float], ends: Iterable[float]) -> list[Interval]:
        """`[Interval(op, start, end) for op, start, end in zip(ops, starts, ends)]`, built field by
        field in bulk: one constructor call per op would dominate simulating a large schedule."""
        fields: list[list[Any]] = [list(ops), list(starts), list(ends)]
        intervals: list[Interval] = list(map(object.__new__, repeat(cls, min(map(len, fields)))))
        slots = [getattr(cls, name) for name in ("op", "start", "end")]  # the __slots__ descriptors
        for slot, values in zip(slots, fields):
            for _ in map(slot.__set__, intervals, values):
                pass
        return intervals


@dataclass(frozen=True, slots=True)
class Bubble:
    """An idle gap of one rank within the step, [start, end)."""

    rank: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Per-rank intervals in execution order; the step spans [0, step_time].

    `comm_end` is when the last asynchronous collective launched in the step completes;
    `tails[rank]` (empty: all 0) the rank's busy end of step, which starts at `tail_start(rank)`:
    after its last op and once its stages' gradient reductions (`reduce_ends[rank]`, empty: all 0)
    are done.
    """

    ranks: tuple[tuple[Interval, ...], ...]
    time_unit: str = "units"
    comm_end: float = 0.0
    tails: tuple[float, ...] = ()
    reduce_ends: tuple[float, ...] = ()

    @cached_property
    def step_time(self) -> float:
        ends = (self.tail_start(rank) + self.tail(rank) for rank in range(self.num_ranks))
        return max(max(ends, default=0.0), self.comm_end)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def tail(self, rank: int) -> float:
        return self.tails[rank] if self.tails else 0.0

    def tail_start(self, rank: int) -> float:
        """When `rank`'s end of step starts: after its last op and its gradient reductions."""
        return max(self.last_end(rank), self.reduce_ends[rank] if self.reduce_ends else 0.0)

    def last_end(self, rank: int) -> float:
        """When `rank`'s last op ends (0 without ops)."""
        return max((iv.end for iv in self.ranks[rank]), default=0.0)

    def busy_time(self, rank: int) -> float:
        """Op time plus the end of step."""
        return sum(iv.duration for iv in self.ranks[rank]) + self.tail(rank)

    def bubble_time(self, rank: int) -> float:
        return self.step_time - self.busy_time(rank)

    def bubbles(self, rank: int, min_duration: float = 1e-9) -> list[Bubble]:
        """Windows for more work on `rank`: its idle gaps in [0, step_time - tail], including before
        its first and after its last op (work placed there ends before the rank's end of step)."""
        gaps, cursor = [], 0.0
        for iv in self.ranks[rank]:
            if iv.start - cursor > min_duration:
                gaps.append(Bubble(rank, cursor, iv.start))
            cursor = max(cursor, iv.end)
        end = self.step_time - self.tail(rank)
        if end - cursor > min_duration:
            gaps.append(Bubble(rank, cursor, end))
        return gaps

    def idle_gaps(self, rank: int, min_duration: float = 1e-9) -> list[Bubble]:
        """Where `rank` is idle, for drawing: the bubbles, but the gap after the last op is split
        around the rank's end of step, which starts at `tail_start` (same total as `bubbles`)."""
        gaps = self.bubbles(rank, min_duration)
        tail = self.tail(rank)
        if tail and gaps and gaps[-1].start >= self.last_end(rank) - 1e-12:
            last, start = gaps.pop(), self.tail_start(rank)
            gaps += [
                gap
                for gap in (Bubble(rank, last.start, start), Bubble(rank, start + tail, last.end + tail))
                if gap.duration > min_duration
            ]
        return gaps

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step, 0..1."""
        total = self.step_time * self.num_ranks
        return sum(self.bubble_time(r) for r in range(self.num_ranks)) / total if total else 0.0
