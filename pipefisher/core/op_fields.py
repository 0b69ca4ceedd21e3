"""An op's layer and part, typed, for the kinds that always have them (`Op.layer` and `Op.part`
are optional because forwards, backwards and per-step ops have neither). Pure Python."""

from __future__ import annotations

from pipefisher.core.ir import Op, ScheduleError


def layer_of(op: Op) -> str:
    """The layer `op` works on; ScheduleError for a kind without one."""
    if op.layer is None:
        raise ScheduleError(f"{op}: a {op.kind.name} op has no layer")
    return op.layer


def micro_batch_of(op: Op) -> int:
    """The micro-batch `op` works on; ScheduleError for a kind without one."""
    if op.micro_batch is None:
        raise ScheduleError(f"{op}: a {op.kind.name} op has no micro-batch")
    return op.micro_batch


def part_of(op: Op) -> int:
    """The index of the part `op` works on; ScheduleError for a kind without parts."""
    if op.part is None:
        raise ScheduleError(f"{op}: a {op.kind.name} op has no part")
    return op.part
