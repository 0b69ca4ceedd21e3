"""Schedule IR: ops, per-rank op lists, their dependencies, JSON round trip and a grid printer.

An `Op` names one unit of work of one pipeline step: the forward or backward of a micro-batch on a
stage, or a K-FAC task of one layer. A `Schedule` gives every rank (device) its ordered op list;
cross-rank order follows from the dependencies in `dependencies()`. Pure Python: no torch here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from enum import Enum
from pathlib import Path

from pipefisher.core.files import write_text_atomically


class OpKind(str, Enum):
    """What an op does; the value is its token in the compact string form."""

    FORWARD = "F"
    #: the whole backward of a micro-batch; its input gradient only where the schedule has W ops
    BACKWARD = "B"
    #: the weight gradient of a micro-batch, split from its backward (zero-bubble schedules)
    WEIGHT = "W"
    CURV_A = "CA"
    CURV_B = "CB"
    SYNC_A = "SA"
    SYNC_B = "SB"
    INV_A = "IA"
    INV_B = "IB"
    EXCHANGE = "X"
    PRECONDITION = "P"

    @property
    def is_compute(self) -> bool:
        """Forward, backward or weight gradient: the ops a plain pipeline schedule consists of."""
        return self in _COMPUTE

    @property
    def has_micro_batch(self) -> bool:
        return self in _WITH_MICRO_BATCH

    @property
    def has_layer(self) -> bool:
        return self not in _WITHOUT_LAYER


_COMPUTE = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT})
_WITH_MICRO_BATCH = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT, OpKind.CURV_A, OpKind.CURV_B})
_WITHOUT_LAYER = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT, OpKind.PRECONDITION})
#: ops that change a stage's gradient of the step: it is final after the last of them on a rank
GRADIENT_KINDS = frozenset({OpKind.BACKWARD, OpKind.WEIGHT, OpKind.PRECONDITION})


class ScheduleError(ValueError):
    """A schedule or its parameters are inconsistent; the message says what and where."""


# Longest tokens first so that "CB" is not read as "C" + "B".
_KIND_TOKENS = "|".join(sorted((k.value for k in OpKind), key=len, reverse=True))
_OP_PATTERN = re.compile(
    rf"^(?:p(?P<pipe>\d+)\.)?(?P<stage>\d+)(?P<kind>{_KIND_TOKENS})(?P<mb>\d+)?(?::(?P<layer>.+))?$"
)


@dataclass(frozen=True, slots=True, order=True, init=False)
class Op:
    """One op of a pipeline step.

    String form: ``[p<pipe>.]<stage><KIND>[<micro-batch>][:<layer>]``, e.g. ``1F3`` (stage 1
    forward of micro-batch 3), ``p1.0B2`` (pipe 1), ``2CA5:block0.fc1`` (curvature A of a layer),
    ``2IB:block0.fc1`` (inverse B). Pipe 0 is left out. Micro-batch ids are global in a step.
    """

    kind: OpKind
    stage: int
    micro_batch: int | None = None
    pipe: int = 0
    layer: str | None = None
    _hash: int = field(init=False, repr=False, compare=False)

    def __init__(
        self, kind: OpKind, stage: int, micro_batch: int | None = None, pipe: int = 0, layer: str | None = None
    ) -> None:
        """Set the fields once (ops are immutable; schedules build tens of thousands of them, so
        this is written out rather than generated) and check them; ScheduleError if they do not
        fit the kind or are negative."""
        set_field = object.__setattr__
        set_field(self, "kind", kind)
        set_field(self, "stage", stage)
        set_field(self, "micro_batch", micro_batch)
        set_field(self, "pipe", pipe)
        set_field(self, "layer", layer)
        set_field(self, "_hash", hash((kind, stage, micro_batch, pipe, layer)))
        if (kind in _WITH_MICRO_BATCH) != (micro_batch is not None):
            need = "needs" if kind.has_micro_batch else "takes no"
            raise ScheduleError(f"op kind {kind.name} {need} a micro-batch")
        if (kind not in _WITHOUT_LAYER) != (layer is not None):
            need = "needs" if kind.has_layer else "takes no"
            raise ScheduleError(f"op kind {kind.name} {need} a layer name")
        if stage < 0 or pipe < 0 or (micro_batch is not None and micro_batch < 0):
            raise ScheduleError(f"op fields must be non-negative: {self!r}")

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[Op], tuple[OpKind, int, int | None, int, str | None]]:
        """Unpickle through the constructor: the cached hash depends on the process (its string
        hash seed), so another process must compute its own."""
        return Op, (self.kind, self.stage, self.micro_batch, self.pipe, self.layer)

    def __str__(self) -> str:
        text = f"p{self.pipe}." if self.pipe else ""
        text += f"{self.stage}{self.kind.value}"
        if self.micro_batch is not None:
            text += str(self.micro_batch)
        if self.layer is not None:
            text += f":{self.layer}"
        return text

    @classmethod
    def parse(cls, text: str) -> Op:
        """Inverse of `str(op)`."""
        match = _OP_PATTERN.match(text.strip())
        if match is None:
            raise ScheduleError(f"cannot parse op {text!r}: expected [p<pipe>.]<stage><KIND>[<micro-batch>][:<layer>]")
        mb = match["mb"]
        return cls(
            kind=OpKind(match["kind"]),
            stage=int(match["stage"]),
            micro_batch=int(mb) if mb is not None else None,
            pipe=int(match["pipe"] or 0),
            layer=match["layer"],
        )

    @property
    def key(self) -> tuple[int, int, int | None]:
        """(pipe, stage, micro-batch): the activation this op belongs to."""
        return (self.pipe, self.stage, self.micro_batch)


def forward(stage: int, micro_batch: int, pipe: int = 0) -> Op:
    return Op(OpKind.FORWARD, stage, micro_batch, pipe)


def backward(stage: int, micro_batch: int, pipe: int = 0) -> Op:
    return Op(OpKind.BACKWARD, stage, micro_batch, pipe)


def weight(stage: int, micro_batch: int, pipe: int = 0) -> Op:
    return Op(OpKind.WEIGHT, stage, micro_batch, pipe)


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered op lists of one training step.

    `placement[(pipe, stage)]` is the rank that holds that stage's parameters; every op of a
    (pipe, stage) runs on that rank. `num_stages` counts model pieces per pipe (for interleaved
    schedules: ranks × chunks). Invariants are checked by `pipefisher.schedules.validate.validate`.
    """

    name: str
    num_stages: int
    num_micro_batches: int
    placement: dict[tuple[int, int], int]
    ranks: tuple[tuple[Op, ...], ...]
    num_pipes: int = 1
    params: dict[str, int] = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @cached_property
    def splits_backward(self) -> bool:
        """Whether its backwards are split: `B` input gradients, `W` weight gradients."""
        return splits_backward(op for ops in self.ranks for op in ops)

    def rank_of(self, op: Op) -> int:
        try:
            return self.placement[(op.pipe, op.stage)]
        except KeyError:
            raise ScheduleError(f"op {op} names pipe {op.pipe}, stage {op.stage}, which has no rank") from None

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """(pipe, stage) pairs held by `rank`, in order."""
        return sorted(key for key, r in self.placement.items() if r == rank)

    def ops(self) -> Iterator[tuple[int, int, Op]]:
        """(rank, position, op) for every op."""
        for rank, ops in enumerate(self.ranks):
            for position, op in enumerate(ops):
                yield rank, position, op

    def with_ranks(self, ranks: Sequence[Sequence[Op]], name: str | None = None) -> Schedule:
        """The same pipeline with other op lists (e.g. K-FAC ops inserted)."""
        return Schedule(
            name=name or self.name,
            num_stages=self.num_stages,
            num_micro_batches=self.num_micro_batches,
            placement=dict(self.placement),
            ranks=tuple(tuple(ops) for ops in ranks),
            num_pipes=self.num_pipes,
            params=dict(self.params),
        )

    def to_dict(self) -> dict:
        return {
            "schema": "pipefisher.schedule/v1",
            "name": self.name,
            "num_stages": self.num_stages,
            "num_micro_batches": self.num_micro_batches,
            "num_pipes": self.num_pipes,
            "params": dict(self.params),
            "placement": [[pipe, stage, rank] for (pipe, stage), rank in sorted(self.placement.items())],
            "ranks": [[str(op) for op in ops] for ops in self.ranks],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        try:
            return cls(
                name=str(data["name"]),
                num_stages=int(data["num_stages"]),
                num_micro_batches=int(data["num_micro_batches"]),
                num_pipes=int(data.get("num_pipes", 1)),
                params={str(k): int(v) for k, v in data.get("params", {}).items()},
                placement={(int(p), int(s)): int(r) for p, s, r in data["placement"]},
                ranks=tuple(tuple(Op.parse(text) for text in ops) for ops in data["ranks"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ScheduleError):
                raise
            raise ScheduleError(f"malformed schedule JSON: {exc!r}") from None

    def save(self, path: str | Path) -> None:
        write_text_atomically(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        return cls.from_dict(json.loads(Path(path).read_text()))


def stage_dependencies(kind: OpKind, stage: int, num_stages: int) -> tuple[tuple[OpKind, int], ...]:
    """(kind, stage) of each op that an op of `kind` on `stage` waits for; all of them share its
    pipe and micro-batch and take no layer. The rule behind `dependencies`, on op fields alone."""
    if kind is OpKind.FORWARD:
        return ((OpKind.FORWARD, stage - 1),) if stage > 0 else ()
    if kind is OpKind.BACKWARD:
        own = (OpKind.FORWARD, stage)
        return (own, (OpKind.BACKWARD, stage + 1)) if stage < num_stages - 1 else (own,)
    if kind is OpKind.WEIGHT:
        return ((OpKind.BACKWARD, stage),)
    if kind is OpKind.CURV_A:
        return ((OpKind.FORWARD, stage),)
    if kind is OpKind.CURV_B:
        return ((OpKind.BACKWARD, stage),)
    return ()


def dependencies(op: Op, num_stages: int) -> tuple[Op, ...]:
    """Ops (of the same step) that must finish before `op` may start, across ranks.

    Forward of stage s needs stage s-1's forward; backward needs its own forward and stage s+1's
    backward; a weight gradient needs its backward (input gradient); curvature A/B needs the forward/backward of its micro-batch. Dependencies among
    K-FAC ops of one layer (sync after all curvature, inverse after sync) are the packer's
    business, since they span steps of a refresh cycle.
    """
    rule = stage_dependencies(op.kind, op.stage, num_stages)
    return tuple([Op(kind, stage, op.micro_batch, op.pipe) for kind, stage in rule])


def format_grid(
    ranks: Sequence[Sequence[object]],  # ops, or any printable cells (the comm plan's actions)
    mark: Iterable[tuple[int, int]] = (),
    max_columns: int = 48,
) -> str:
    """Text grid with one row per rank and one column per list position.

    Cells listed in `mark` as (rank, position) are wrapped in ``>…<``. Columns past `max_columns`
    are elided around the first mark so that the offending op stays visible.
    """
    marks = set(mark)
    length = max((len(ops) for ops in ranks), default=0)
    first = min((pos for _, pos in marks), default=0)
    start = max(0, min(first - max_columns // 2, length - max_columns))
    stop = min(length, start + max_columns)
    cells = [
        [
            (f">{ops[pos]}<" if (rank, pos) in marks else str(ops[pos])) if pos < len(ops) else "."
            for pos in range(start, stop)
        ]
        for rank, ops in enumerate(ranks)
    ]
    width = max((len(c) for row in cells for c in row), default=1)
    lines = []
    for rank, row in enumerate(cells):
        prefix = "… " if start > 0 else ""
        suffix = " …" if stop < length else ""
        lines.append(f"rank {rank:>2}: {prefix}" + " ".join(c.rjust(width) for c in row) + suffix)
    return "\n".join(lines)


def splits_backward(ops: Iterable[Op]) -> bool:
    """Whether the ops hold weight-gradient ops, i.e. their backwards compute input gradients only."""
    return any(op.kind is OpKind.WEIGHT for op in ops)


def _peak_held(ops: Sequence[Op], take: OpKind, release: OpKind) -> int:
    """Most micro-batches held at once over an op list: from their `take` op until their `release` op."""
    held = peak = 0
    for op in ops:
        if op.kind is take:
            held += 1
            peak = max(peak, held)
        elif op.kind is release:
            held -= 1
    return peak


def peak_activations(ops: Sequence[Op]) -> int:
    """Most forwards held at once over an op list, in micro-batches: from the forward until the
    backward, or until the weight gradient where the list splits the backward (what the weight
    gradient needs is held until then)."""
    return _peak_held(ops, OpKind.FORWARD, OpKind.WEIGHT if splits_backward(ops) else OpKind.BACKWARD)


def peak_pending_weights(ops: Sequence[Op]) -> int:
    """Most micro-batches whose input gradient has run and weight gradient has not, at once."""
    return _peak_held(ops, OpKind.BACKWARD, OpKind.WEIGHT) if splits_backward(ops) else 0
