"""The communication of help ops (`OpKind.HELP`: a layer's per-step work of another rank's stage,
`pipefisher.planning.packing.helpers`), on the communicator ``("help", owner, helper)`` of the
stage's rank and its helper.

The stage's rank launches ``help_in`` (its method broadcasts the helped layers' inputs of the
step) right after the op that makes the stage's gradient final, and ``help_out`` (the receive of
the results) right after it; the helper launches ``help_in`` and waits for it before its first help
op of the stage, and launches ``help_out`` (the broadcast of the results) after its last. Both
ranks wait for both at their end of step, before the world reduction, so the results are in before
the optimizer step. A method with refresh work (`helps_read_state`: K-FAC's help op applies the
layer's inverses) also sends the helper the refresh results in use, once per cycle: in the cycle's
first step both ranks launch ``help_state`` before their first op (its transfer overlaps the step's
compute), the helper waits for it before its first help op of the stage, the stage's rank at its
end of step. The same order on both ranks of the communicator: NCCL's rule holds by
construction, and `pipefisher.planning.comm.replay` checks it. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import Action, ActionKind, Collective, CollectiveKind, help_collective
from pipefisher.planning.packing.helpers import helped_layers
from pipefisher.planning.plan import Plan

#: (pipe, stage) of a helped stage
StageKey = tuple[int, int]


def helps_read_state(plan: Plan) -> bool:
    """Whether `plan`'s help ops read their layers' refresh results (its method has refresh work),
    which then cross to the helpers at the start of every cycle (``help_state``)."""
    return plan.rules is not None and bool(plan.rules.parts) and bool(helped_layers(plan))


def stage_helpers(plan: Plan) -> dict[StageKey, tuple[int, ...]]:
    """(pipe, stage) -> the pipeline ranks that help it, in rank order (empty: no help ops)."""
    return {key: tuple(sorted({rank for _, rank in layers})) for key, layers in helped_layers(plan).items()}


@dataclass(frozen=True)
class HelpActions:
    """One rank's help actions in a step: its ops `ops`, its global `rank` and `replica`; the
    helpers of every helped stage (`stage_helpers`); `state`: the step sends the helpers their
    layers' refresh results (the cycle's first step, where `helps_read_state`)."""

    topology: Topology
    ops: Sequence[Op]
    rank: int
    replica: int
    helpers: dict[StageKey, tuple[int, ...]]
    state: bool = False
    _first: dict[int, StageKey] = field(init=False)
    _last: dict[int, StageKey] = field(init=False)

    def __post_init__(self) -> None:
        first: dict[StageKey, int] = {}
        last: dict[StageKey, int] = {}
        for position, op in enumerate(self.ops):
            if op.kind is OpKind.HELP:
                first.setdefault((op.pipe, op.stage), position)
                last[(op.pipe, op.stage)] = position
        object.__setattr__(self, "_first", {position: key for key, position in first.items()})
        object.__setattr__(self, "_last", {position: key for key, position in last.items()})

    def before(self, position: int) -> Iterator[Action]:
        """Before the op at `position`: at the first, the launches of the step's ``help_state``
        (where `state`); a helper's launch of, and wait for, the stage's inputs (and its state)."""
        if position == 0 and self.state:
            yield from (Action(ActionKind.LAUNCH, collective) for collective in self._states())
        key = self._first.get(position)
        if key is not None:
            collective = self._collective(CollectiveKind.HELP_IN, key, self.rank)
            yield from (Action(ActionKind.LAUNCH, collective), Action(ActionKind.WAIT, collective))
            if self.state:
                yield Action(ActionKind.WAIT, self._collective(CollectiveKind.HELP_STATE, key, self.rank))

    def _states(self) -> Iterator[Collective]:
        """The ``help_state`` of every stage this rank holds to each of its helpers, then of every
        stage it helps, in stage order (one order per communicator on both of its ranks)."""
        for key in sorted(self.helpers):
            if self.topology.rank(self.replica, *key) == self.rank:
                for helper in self.helpers[key]:
                    global_helper = self.replica * self.topology.pipeline_ranks + helper
                    yield self._collective(CollectiveKind.HELP_STATE, key, global_helper)
        for key in sorted(set(self._first.values())):
            yield self._collective(CollectiveKind.HELP_STATE, key, self.rank)

    def after(self, position: int, final_stage: int | None) -> Iterator[Action]:
        """After the op at `position` (`final_stage`: the stage whose gradient it makes final, the
        precondition op aside): the stage's launches of its helpers' inputs and results, or a
        helper's launch of its results after its last help op of a stage."""
        op = self.ops[position]
        if final_stage is not None:
            for helper in self.helpers.get((op.pipe, final_stage), ()):
                global_helper = self.replica * self.topology.pipeline_ranks + helper
                for kind in (CollectiveKind.HELP_IN, CollectiveKind.HELP_OUT):
                    yield Action(ActionKind.LAUNCH, self._collective(kind, (op.pipe, final_stage), global_helper))
        key = self._last.get(position)
        if key is not None:
            yield Action(ActionKind.LAUNCH, self._collective(CollectiveKind.HELP_OUT, key, self.rank))

    def _collective(self, kind: CollectiveKind, key: StageKey, helper: int) -> Collective:
        pipe, stage = key
        return help_collective(kind, self.topology.rank(self.replica, pipe, stage), helper, stage)


def help_waits(actions: Sequence[Action]) -> list[Action]:
    """The end-of-step waits for the help collectives `actions` launched and did not wait for."""
    waited = {a.target for a in actions if a.kind is ActionKind.WAIT}
    return [
        Action(ActionKind.WAIT, a.collective)
        for a in actions
        if a.kind is ActionKind.LAUNCH
        and a.collective.kind in (CollectiveKind.HELP_STATE, CollectiveKind.HELP_IN, CollectiveKind.HELP_OUT)
        and a.collective not in waited
    ]
