"""Schedule IR: ops, per-rank op lists, their dependencies, JSON round trip and a grid printer.

An `Op` names one unit of work of one pipeline step: the forward or backward of a micro-batch on a
stage, or a task of a curvature method on one layer. A `Schedule` gives every rank (device) its
ordered op list; cross-rank order follows from the dependencies in `dependencies()`. Pure Python:
no torch here.

A method's refresh work of a layer has parts 0..n-1 (K-FAC's A and B factors, Shampoo's left and
right roots; the method's declaration names them), and curvature, sync and refresh ops carry the
index of their part (`Op.part`). String form, version 2 (what `str(op)` writes):
``[p<pipe>.]<stage><KIND>[<part>][.<micro-batch>|<micro-batch>][:<layer>]``: a kind that has parts
(``C`` curvature, ``S`` sync, ``R`` refresh) is followed by the part's index, and then by ``.``
and the micro-batch where it has one: ``2C0.5:block0.fc1`` (curvature of part 0 of micro-batch
5), ``2S1:block0.fc1`` (sync of part 1), ``2R1:block0.fc1`` (refresh of part 1). The other kinds
are written as before: ``1F3``, ``p1.0B2``, ``0W1``, ``3X:block0.fc1``, ``2P``, ``2U``, ``1H:block0.fc1``.

Version 1 (plans written before parts had indices) is read as well: ``2CA5:block0.fc1`` is
curvature of part 0, ``CB`` of part 1; ``SA``/``SB`` syncs and ``IA``/``IB`` refresh work of parts
0 and 1.
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
    #: a part's curvature of one micro-batch
    CURVATURE = "C"
    #: an all-reduce of a part's input over the stage's replicas
    SYNC = "S"
    #: a part's refresh work (K-FAC: an inverse; Shampoo: a root; SOAP: an eigenbasis)
    REFRESH = "R"
    EXCHANGE = "X"
    PRECONDITION = "P"
    #: a stage's fold of the previous step's final gradient into its statistics (SOAP), deferred
    #: from that step's end into this step's bubbles
    FOLD = "U"
    #: a layer's per-step work of another rank's stage, done on this rank (`rules.helpers`)
    HELP = "H"

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

    @property
    def has_part(self) -> bool:
        return self in PART_KINDS


_COMPUTE = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT})
_WITH_MICRO_BATCH = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT, OpKind.CURVATURE})
#: the kinds whose ops do the work of one part of a layer (`Op.part`)
PART_KINDS = frozenset({OpKind.CURVATURE, OpKind.SYNC, OpKind.REFRESH})
_WITHOUT_LAYER = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT, OpKind.PRECONDITION, OpKind.FOLD})
#: the kinds of a method's ops that recur in every step of a cycle (one per (pipe, stage); a help per layer)
PER_STEP_KINDS = frozenset({OpKind.PRECONDITION, OpKind.FOLD, OpKind.HELP})
#: ops that change a stage's gradient of the step: it is final after the last of them on a rank
GRADIENT_KINDS = frozenset({OpKind.BACKWARD, OpKind.WEIGHT, OpKind.PRECONDITION})


class ScheduleError(ValueError):
    """A schedule or its parameters are inconsistent; the message says what and where."""


#: the version-1 tokens of the kinds with parts: (kind, part)
_V1_TOKENS = {
    "CA": (OpKind.CURVATURE, 0),
    "CB": (OpKind.CURVATURE, 1),
    "SA": (OpKind.SYNC, 0),
    "SB": (OpKind.SYNC, 1),
    "IA": (OpKind.REFRESH, 0),
    "IB": (OpKind.REFRESH, 1),
}
_PART_TOKENS = "".join(kind.value for kind in sorted(PART_KINDS))
_OTHER_TOKENS = "".join(kind.value for kind in OpKind if kind not in PART_KINDS)
_OP_PATTERN = re.compile(
    r"^(?:p(?P<pipe>\d+)\.)?(?P<stage>\d+)(?:"
    rf"(?P<v1>{'|'.join(_V1_TOKENS)})(?P<v1_mb>\d+)?"
    rf"|(?P<part_kind>[{_PART_TOKENS}])(?P<part>\d+)(?:\.(?P<part_mb>\d+))?"
    rf"|(?P<kind>[{_OTHER_TOKENS}])(?P<mb>\d+)?"
    r")(?::(?P<layer>.+))?$"
)


@dataclass(frozen=True, slots=True, order=True, init=False)
class Op:
    """One op of a pipeline step; `part`: the part of a layer's work (curvature, sync, refresh
    ops; None for the other kinds). String form as the module docstring says: ``1F3`` (stage 1
    forward of micro-batch 3), ``p1.0B2`` (pipe 1), ``2C0.5:block0.fc1`` (curvature of part 0),
    ``2R1:block0.fc1`` (refresh of part 1). Pipe 0 is left out. Micro-batch ids are global in a step.
    """

    kind: OpKind
    stage: int
    micro_batch: int | None = None
    pipe: int = 0
    layer: str | None = None
    part: int | None = None
    _hash: int = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        kind: OpKind,
        stage: int,
        micro_batch: int | None = None,
        pipe: int = 0,
        layer: str | None = None,
        part: int | None = None,
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
        set_field(self, "part", part)
        set_field(self, "_hash", hash((kind, stage, micro_batch, pipe, layer, part)))
        if (kind in _WITH_MICRO_BATCH) != (micro_batch is not None):
            need = "needs" if kind.has_micro_batch else "takes no"
            raise ScheduleError(f"op kind {kind.name} {need} a micro-batch")
        if (kind not in _WITHOUT_LAYER) != (layer is not None):
            need = "needs" if kind.has_layer else "takes no"
            raise ScheduleError(f"op kind {kind.name} {need} a layer name")
        if (kind in PART_KINDS) != (part is not None):
            need = "needs" if kind.has_part else "takes no"
            raise ScheduleError(f"op kind {kind.name} {need} a part index")
        if stage < 0 or pipe < 0 or (micro_batch is not None and micro_batch < 0) or (part is not None and part < 0):
            raise ScheduleError(f"op fields must be non-negative: {self!r}")

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[Op], tuple[OpKind, int, int | None, int, str | None, int | None]]:
        """Unpickle through the constructor: the cached hash depends on the process (its string
        hash seed), so another process must compute its own."""
        return Op, (self.kind, self.stage, self.micro_batch, self.pipe, self.layer, self.part)

    @property
    def token(self) -> str:
        """The kind's token with the part's index (``C0``, ``R1``; ``F`` for a kind without parts)."""
        return self.kind.value if self.part is None else f"{self.kind.value}{self.part}"

    def __str__(self) -> str:
        text = f"p{self.pipe}." if self.pipe else ""
        text += f"{self.stage}{self.token}"
        if self.micro_batch is not None:
            text += f".{self.micro_batch}" if self.part is not None else str(self.micro_batch)
        if self.layer is not None:
            text += f":{self.layer}"
        return text

    @classmethod
    def parse(cls, text: str) -> Op:
        """Inverse of `str(op)`; reads the version-1 form as well (module docstring)."""
        match = _OP_PATTERN.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse op {text!r}: expected [p<pipe>.]<stage><KIND>[<part>][.<micro-batch>][:<layer>]"
            )
        part: int | None = None
        if match["v1"] is not None:
            kind, part = _V1_TOKENS[match["v1"]]
            mb = match["v1_mb"]
        elif match["part_kind"] is not None:
            kind, part, mb = OpKind(match["part_kind"]), int(match["part"]), match["part_mb"]
        else:
            kind, mb = OpKind(match["kind"]), match["mb"]
        return cls(
            kind=kind,
            stage=int(match["stage"]),
            micro_batch=int(mb) if mb is not None else None,
            pipe=int(match["pipe"] or 0),
            layer=match["layer"],
            part=part,
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
    """(kind, stage) of each compute op that a compute op of `kind` on `stage` waits for; all of
    them share its pipe and micro-batch. The rule behind `dependencies`, on op fields alone
    (what a curvature op reads depends on its method: `pipefisher.planning.tasks`)."""
    if kind is OpKind.FORWARD:
        return ((OpKind.FORWARD, stage - 1),) if stage > 0 else ()
    if kind is OpKind.BACKWARD:
        own = (OpKind.FORWARD, stage)
        return (own, (OpKind.BACKWARD, stage + 1)) if stage < num_stages - 1 else (own,)
    if kind is OpKind.WEIGHT:
        return ((OpKind.BACKWARD, stage),)
    return ()


def dependencies(op: Op, num_stages: int) -> tuple[Op, ...]:
    """Ops (of the same step) that must finish before `op` may start, across ranks.

    Forward of stage s needs stage s-1's forward; backward needs its own forward and stage s+1's
    backward; a weight gradient needs its backward (input gradient). Dependencies of a method's
    ops (curvature after the forward or backward it reads, sync after all curvature, refresh after
    sync) are the task graph's business (`pipefisher.planning.tasks`), since they follow the
    method's rules and span steps of a refresh cycle.
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
