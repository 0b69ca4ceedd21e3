"""A schedule's per-rank activation peaks as a maximum of integer dot products: the fast path of
`pipefisher.planning.memory.activations.activation_peaks`. Pure Python: no torch.

What `activation_held` counts at every op of a rank is a sum of per-stage byte counts, each taken
an integer number of times: the stage bytes of the micro-batches in flight, the pending bytes of
those between their B and W, a backward's transient bytes, the sent bytes of the sends not yet
waited for. Those numbers depend on the schedule only, so they are traced once per schedule
object (`schedule_rows`), each held state a coefficient row over the rank's features; a call then
takes, per rank, the largest dot product of a row with the byte vectors. Rows equal to another or
dominated by one (no coefficient larger) are dropped: with bytes >= 0 they never hold the
maximum. Python integers keep every sum exact, so the result equals the op-by-op count for
non-negative integer bytes (`linear_peaks` declines other inputs: None).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from operator import ge, mul

from pipefisher.core.ir import Op, OpKind, Schedule
from pipefisher.planning.comm.send_waits import SendWait, schedule_send_waits

#: the byte vectors a feature reads, by index: (stage, pending, transient, sent forward, sent backward)
STAGE, PENDING, TRANSIENT, SENT_FORWARD, SENT_BACKWARD = range(5)


@dataclass(frozen=True)
class RankRows:
    """One rank's held states: `features` (vector index as above, stage) and, per state that can
    be the peak, its coefficient per feature (`rows`, none dominated by another)."""

    features: tuple[tuple[int, int], ...]
    rows: tuple[tuple[int, ...], ...]

    def peak(self, vectors: Sequence[Sequence[int]]) -> int:
        """The largest row · (each feature's bytes in `vectors`) (0 without rows)."""
        values = [vectors[which][stage] for which, stage in self.features]
        return max((sum(map(mul, row, values)) for row in self.rows), default=0)


def weighted_micro_batches(schedule: Schedule) -> set[tuple]:
    """(pipe, stage, micro-batch) of every weight op (W) of `schedule` (split backward)."""
    return {(op.pipe, op.stage, op.micro_batch) for ops in schedule.ranks for op in ops if op.kind is OpKind.WEIGHT}


def rank_rows(ops: Sequence[Op], weighted: set[tuple], waits: dict[int, SendWait | None] | None) -> RankRows:
    """The held states of one rank's op list as `activation_held` walks it (`waits`: its sends'
    waits, None: no sends counted) that can be its peak for bytes >= 0, deduplicated and without
    dominated rows: those after a forward and during and after a backward. Every other change
    (a weight op, a wait) only frees bytes, so the state after it is dominated by an earlier one
    (or by nothing held, the first state, where the peak of no rows, 0, is right)."""
    counted = (OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT)
    stages = sorted({op.stage for op in ops if op.kind in counted})
    features = [(which, stage) for stage in stages for which in (STAGE, PENDING, TRANSIENT)]
    base = {stage: 3 * number for number, stage in enumerate(stages)}  # its STAGE; PENDING +1, TRANSIENT +2
    added: dict[int, int] = {}
    before: dict[int, list[int]] = {}
    after: dict[int, list[int]] = {}
    sent: dict[tuple[int, int], int] = {}
    for position, slot in (waits or {}).items():
        op = ops[position]
        named = (SENT_FORWARD if op.kind is OpKind.FORWARD else SENT_BACKWARD, op.stage)
        if named not in sent:
            sent[named] = len(features)
            features.append(named)
        added[position] = sent[named]
        if slot is not None:
            (after if slot.after_run else before).setdefault(slot.position, []).append(added[position])
    held = [0] * len(features)
    states: set[tuple[int, ...]] = set()
    for position, op in enumerate(ops):
        for feature in before.get(position, ()):
            held[feature] -= 1
        kind = op.kind
        if kind is OpKind.FORWARD:
            held[base[op.stage]] += 1
            if position in added:
                held[added[position]] += 1
            states.add(tuple(held))
        elif kind is OpKind.BACKWARD:
            at = base[op.stage]
            held[at + 2] += 1
            states.add(tuple(held))
            held[at + 2] -= 1
            if (op.pipe, op.stage, op.micro_batch) in weighted:
                held[at + 1] += 1
            held[at] -= 1
            if position in added:
                held[added[position]] += 1
            states.add(tuple(held))
        elif kind is OpKind.WEIGHT:
            held[base[op.stage] + 1] -= 1
        for feature in after.get(position, ()):
            held[feature] -= 1
    return RankRows(tuple(features), _undominated(states))


def _undominated(rows: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """`rows` less those no larger anywhere than another (largest sum first): a row dominated by
    a dropped one is dominated by the row that dropped it."""
    kept: list[tuple[int, ...]] = []
    for row in sorted(rows, key=lambda row: (-sum(row), row)):
        if not any(all(map(ge, other, row)) for other in kept):
            kept.append(row)
    return tuple(kept)


#: id(schedule) -> (a weak reference to it, {whether sends are counted: its rows per rank})
_SCHEDULE_ROWS: dict[int, tuple[weakref.ref, dict[bool, tuple[RankRows, ...]]]] = {}


def schedule_rows(schedule: Schedule, sends: bool) -> tuple[RankRows, ...]:
    """`rank_rows` of every rank of `schedule` (`sends`: counting the sends, held until
    `schedule_send_waits`), computed once per schedule object while it lives."""
    key = id(schedule)
    cached = _SCHEDULE_ROWS.get(key)
    if cached is None or cached[0]() is not schedule:
        cached = _SCHEDULE_ROWS[key] = (weakref.ref(schedule, lambda _: _SCHEDULE_ROWS.pop(key, None)), {})
    found = cached[1].get(sends)
    if found is None:
        weighted = weighted_micro_batches(schedule)
        waits: Sequence[dict[int, SendWait | None] | None] = (
            schedule_send_waits(schedule) if sends else [None] * schedule.num_ranks
        )
        found = cached[1][sends] = tuple(
            rank_rows(ops, weighted, waits[rank]) for rank, ops in enumerate(schedule.ranks)
        )
    return found


def _bytes(values: Sequence) -> bool:
    return all(type(value) is int and value >= 0 for value in values)


def linear_peaks(
    schedule: Schedule,
    stage_bytes: Sequence[int],
    pending_bytes: Sequence[int],
    transient_bytes: Sequence[int],
    sent_bytes: Sequence[tuple[int, int]] | None,
) -> list[int] | None:
    """Per rank, `activation_peaks` of these per-stage bytes through `schedule_rows`; None where
    a byte count is not a non-negative int (the rows' pruning and exact sums assume it)."""
    sent = sent_bytes or []
    forward, backward = [pair[0] for pair in sent], [pair[1] for pair in sent]
    if not all(_bytes(values) for values in (stage_bytes, pending_bytes, transient_bytes, forward, backward)):
        return None
    vectors = (stage_bytes, pending_bytes, transient_bytes, forward, backward)
    return [rows.peak(vectors) for rows in schedule_rows(schedule, sent_bytes is not None)]
