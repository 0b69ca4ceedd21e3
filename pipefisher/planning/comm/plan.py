"""Every rank's communication in issue order, derived from a plan, and a replay under NCCL's rules.

NCCL runs the operations of one communicator in the order they were issued, each blocking the
communicator until its peers have matched it. So the executor does not decide on the fly what to
send or receive: `plan_actions` turns a plan into one list of actions per global rank and step,
the executor performs exactly those lists, and `replay` checks before anything runs that they
complete under that rule.

Communicators (group keys), one per purpose so that no two purposes queue behind each other:
- ``("fwd", replica, pipe, s)``: activations stage s -> s + 1; ``("bwd", replica, pipe, s)``: their
  gradients s + 1 -> s. One sender, one receiver, messages in micro-batch order on both ends.
- ``("grad", s)``: stage s's gradient reduction over its replicas (pipes x data-parallel); with
  ZeRO-1 (`GradientPath.sharded`) the reduction goes to each parameter's owner and, after the
  optimizer step, the owners broadcast the updated parameters on the same communicator
  (``gather``); with PowerSGD (`GradientPath.compressed`) the reduction is two all-reduces, of the
  P factors (with the uncompressed tensors) and, once those are in, of the Q factors (``grad_q``).
- ``("pgrad", s, b)``: K-FAC's gradient workers (`pipefisher.planning.layouts.kaisa`): block b of stage s's
  replicas, to which its workers broadcast the preconditioned gradients (``pgrad``).
- ``("curv", s)``: stage s's curvature syncs (K-FAC factors, Shampoo's gradient) and exchanges
  of inverses or roots over the same replicas.
- ``("tied",)``: tied weights (first and last stage); ``("world",)``: the end-of-step reduction
  (loss, gradient norm, overflow flag) over all ranks.

Actions: RUN an op; POST the receive of a message; SEND a message right after the op that made
it; LAUNCH a collective; WAIT for a message, a send or a collective. A rank waits for an op's
input right before the op, and posts the receive of its next input right after (one receive ahead,
so transfers overlap compute). Pure Python: no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

from pipefisher.core.ir import GRADIENT_KINDS, Op, OpKind, ScheduleError
from pipefisher.core.topology import Topology
from pipefisher.methods.method import TaskRules
from pipefisher.methods.registry import task_rules
from pipefisher.planning.layouts.kaisa import GradWorkers
from pipefisher.planning.plan import Plan
from pipefisher.planning.tasks import FACTOR_OF

GroupKey = tuple


class CommOrderError(ScheduleError):
    """The issue order deadlocks or mismatches under NCCL's rule; the message has the grid."""


@dataclass(frozen=True, slots=True)
class Message:
    """The tensor that `consumer` needs from another stage: an activation (into a forward) or a
    gradient (into a backward). Named after its consumer, e.g. ``1F3`` or ``0B3``."""

    consumer: Op

    @property
    def producer(self) -> Op:
        op = self.consumer
        stage = op.stage - 1 if op.kind is OpKind.FORWARD else op.stage + 1
        return Op(op.kind, stage, op.micro_batch, op.pipe)

    @property
    def lower_stage(self) -> int:
        """The lower stage of the boundary the message crosses."""
        return min(self.consumer.stage, self.producer.stage)

    def channel(self, replica: int) -> GroupKey:
        direction = "fwd" if self.consumer.kind is OpKind.FORWARD else "bwd"
        return (direction, replica, self.consumer.pipe, self.lower_stage)

    def __str__(self) -> str:
        return str(self.consumer)


def input_message(op: Op, num_stages: int) -> Message | None:
    """The message `op` consumes, if it is a forward past the first stage or a backward before
    the last."""
    if (op.kind is OpKind.FORWARD and op.stage > 0) or (op.kind is OpKind.BACKWARD and op.stage < num_stages - 1):
        return Message(op)
    return None


def output_message(op: Op, num_stages: int) -> Message | None:
    """The message `op` produces for the neighbouring stage, if any."""
    if op.kind is OpKind.FORWARD and op.stage < num_stages - 1:
        return Message(Op(OpKind.FORWARD, op.stage + 1, op.micro_batch, op.pipe))
    if op.kind is OpKind.BACKWARD and op.stage > 0:
        return Message(Op(OpKind.BACKWARD, op.stage - 1, op.micro_batch, op.pipe))
    return None


class CollectiveKind(str, Enum):
    """What a collective does; the value is its name in messages and traces."""

    #: a curvature method's sync of a statistic's input over a stage's replicas
    SYNC = "sync"
    #: a refresh result (inverse, root) broadcast from the replica that computed it
    EXCHANGE = "exchange"
    #: a replicated stage's gradient reduction (ZeRO-1: to the owners)
    GRAD = "grad"
    #: PowerSGD's second reduction, of the Q factors
    GRAD_Q = "grad_q"
    #: gradient workers' broadcast of each layer's preconditioned gradient within a block
    PGRAD = "pgrad"
    #: ZeRO-1's broadcast of the updated parameters from their owners
    GATHER = "gather"
    #: the sum of a tied weight's gradient over the stages that hold copies
    TIED = "tied"
    #: the world reduction of the step's loss, norm and flags (the optimizer step follows it)
    STEP = "step"


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective call on `group`: its kind and what it is of (e.g. (stage, layer, factor)
    for a sync)."""

    kind: CollectiveKind
    group: GroupKey
    key: tuple = ()

    def __str__(self) -> str:
        return ":".join([self.kind.value, *(str(part) for part in self.key)])


@dataclass(frozen=True, slots=True)
class SendDone:
    """What a WAIT for a send names: the send of `message` has completed."""

    message: Message


class ActionKind(str, Enum):
    RUN = "run"
    POST = "post"
    SEND = "send"
    LAUNCH = "launch"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class Action:
    """One thing a rank does, in issue order. `target` is the op (RUN), the message (POST, SEND,
    WAIT for a receive), a `SendDone` (WAIT for a send) or the collective. POST and SEND
    name the communicator (`group`) and the other end's global rank (`peer`)."""

    kind: ActionKind
    target: Op | Message | Collective | tuple
    group: GroupKey | None = None
    peer: int | None = None

    def __str__(self) -> str:
        if self.kind is ActionKind.RUN:
            return str(self.target)
        if isinstance(self.target, tuple):
            return f"wsend:{self.target[1]}"
        prefix = {ActionKind.POST: "recv:", ActionKind.SEND: "send:", ActionKind.LAUNCH: "+", ActionKind.WAIT: "w:"}[self.kind]
        return prefix + str(self.target)


def run(op: Op) -> Action:
    return Action(ActionKind.RUN, op)


@dataclass(frozen=True)
class GradientPath:
    """How a replicated stage's gradient travels at the end of a step: `sharded` (ZeRO-1: reduced
    to the parameters' owners, who broadcast the updated parameters after the world reduction),
    `compressed` (PowerSGD: a second all-reduce, of the Q factors, once the first is in),
    `workers_per_layer` (K-FAC with G gradient workers per layer, fewer than the stage's
    replicas: once reduced, they precondition their layers and broadcast them within their block,
    ``pgrad``; None: every replica preconditions before the reduction)."""

    sharded: bool = False
    compressed: bool = False
    workers_per_layer: int | None = None


@dataclass(frozen=True)
class CommPlan:
    """`steps[j][rank]`: the actions of global `rank` in step j of the cycle; `members[group]`:
    the global ranks of every communicator the actions use."""

    topology: Topology
    steps: tuple[tuple[tuple[Action, ...], ...], ...]
    members: dict[GroupKey, tuple[int, ...]]

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def outstanding(self, step: int, rank: int) -> tuple[list[Collective], list[Collective]]:
        """At the boundary before cycle step `step`: the collectives `rank` launched earlier in the
        cycle and waits for later, split into those every member has launched by then (they can
        complete now) and those some member launches later. In launch order."""
        launched_by: dict[Collective, set[int]] = defaultdict(set)
        for earlier in self.steps[:step]:
            for other, actions in enumerate(earlier):
                for action in actions:
                    if action.kind is ActionKind.LAUNCH:
                        launched_by[action.target].add(other)
        open_: dict[Collective, None] = {}  # launched, not yet waited for: in launch order
        for earlier in self.steps[:step]:
            for action in earlier[rank]:
                if action.kind is ActionKind.LAUNCH:
                    open_[action.target] = None
                elif action.kind is ActionKind.WAIT:
                    open_.pop(action.target, None)
        complete, incomplete = [], []
        for collective in open_:
            everyone = launched_by[collective] >= set(self.members[collective.group])
            (complete if everyone else incomplete).append(collective)
        return complete, incomplete


def plan_actions(topology: Topology, plan: Plan, tied: bool = False, path: GradientPath = GradientPath()) -> CommPlan:
    """The actions of every global rank for every step of `plan`'s cycle (see the module docstring).

    `tied`: the model has weights shared by the first and last stage (their gradients are summed
    over the ``("tied",)`` group at the end of every step). `path.sharded`: the owners of a
    replicated stage's parameters broadcast them after the world reduction (when the optimizer
    step has run), stage by stage in ascending order on every rank. `path.compressed`: each
    gradient reduction is followed, once waited for, by its ``grad_q`` all-reduce.
    """
    schedule = plan.schedule
    num_stages = schedule.num_stages
    owners = inverse_owners(plan)
    rules = task_rules(plan.method)
    synced = {(op.stage, op.layer, FACTOR_OF[op.kind]) for op in plan.curvature_ops() if op.kind in (OpKind.SYNC_A, OpKind.SYNC_B)}
    tied_ranks = tied_ranks_of(topology) if tied else ()
    replicated = {stage for stage in range(num_stages) if len(topology.replica_ranks(stage)) > 1}
    steps = []
    #: per rank, the syncs it has waited for in the cycle so far (a sync feeds several ops)
    waited: list[set[Collective]] = [set() for _ in range(topology.world_size)]
    for index, step in enumerate(plan.steps):
        last_step = index == len(plan.steps) - 1
        ranks = []
        for rank in range(topology.world_size):
            replica = topology.replica_of(rank)
            ops = step[topology.pipeline_rank(rank)]
            actions = list(_op_actions(topology, ops, replica, rank, owners, synced, replicated, rules, waited[rank]))
            actions += _end_of_step(topology, rank, actions, tied_ranks, path)
            if last_step:
                exchanges = [a.target for s in steps for a in s[rank] if a.kind is ActionKind.LAUNCH and a.target.kind is CollectiveKind.EXCHANGE]
                exchanges += [a.target for a in actions if a.kind is ActionKind.LAUNCH and a.target.kind is CollectiveKind.EXCHANGE]
                actions += [Action(ActionKind.WAIT, c) for c in exchanges]
            ranks.append(tuple(actions))
        steps.append(tuple(ranks))
    return CommPlan(topology, tuple(steps), group_members(topology, tied, path))


def inverse_owners(plan: Plan) -> dict[tuple[int, str, str], int]:
    """(stage, layer, factor) -> the pipe whose rank computes that inverse."""
    owners: dict[tuple[int, str, str], int] = {}
    for op in plan.curvature_ops():
        if op.kind in (OpKind.INV_A, OpKind.INV_B):
            owners.setdefault((op.stage, op.layer, FACTOR_OF[op.kind]), op.pipe)
    return owners


def tied_ranks_of(topology: Topology) -> tuple[int, ...]:
    """The ranks holding the first or the last stage (tied weights' copies); () with one stage."""
    last = topology.schedule.num_stages - 1
    if last == 0:
        return ()
    return tuple(sorted(set(topology.replica_ranks(0)) | set(topology.replica_ranks(last))))


def sync_collective(stage: int, layer: str, factor: str) -> Collective:
    return Collective(CollectiveKind.SYNC, ("curv", stage), (stage, layer, factor))


def exchange_collective(stage: int, layer: str, factor: str) -> Collective:
    return Collective(CollectiveKind.EXCHANGE, ("curv", stage), (stage, layer, factor))


def grad_collective(stage: int) -> Collective:
    return Collective(CollectiveKind.GRAD, ("grad", stage), (stage,))


def grad_q_collective(stage: int) -> Collective:
    """PowerSGD's all-reduce of stage `stage`'s Q factors (after the one of its P factors)."""
    return Collective(CollectiveKind.GRAD_Q, ("grad", stage), (stage,))


def pgrad_collective(topology: Topology, rank: int, stage: int, workers: int) -> Collective:
    """The broadcasts of stage `stage`'s preconditioned gradients within `rank`'s block."""
    grid = GradWorkers(topology.replica_ranks(stage), workers)
    return Collective(CollectiveKind.PGRAD, ("pgrad", stage, grid.block(rank)), (stage,))


def gather_collective(stage: int) -> Collective:
    """ZeRO-1's broadcast of stage `stage`'s updated parameters from their owners."""
    return Collective(CollectiveKind.GATHER, ("grad", stage), (stage,))


TIED = Collective(CollectiveKind.TIED, ("tied",))
STEP = Collective(CollectiveKind.STEP, ("world",))


def _op_actions(topology: Topology, ops: Sequence[Op], replica: int, rank: int, owners: dict, synced: set, replicated: set[int],
                rules: TaskRules, waited: set[Collective]) -> Iterator[Action]:
    num_stages = topology.schedule.num_stages

    def rank_of(op: Op) -> int:
        return topology.rank(replica, op.pipe, op.stage)

    def post(message: Message) -> Action:
        return Action(ActionKind.POST, message, message.channel(replica), rank_of(message.producer))

    inputs = [input_message(op, num_stages) for op in ops]
    receiving = [i for i, message in enumerate(inputs) if message is not None and rank_of(message.producer) != rank]
    next_receive = dict(zip(receiving, receiving[1:]))
    receives_here = set(receiving)
    gradient_final = _gradient_final_positions(ops)
    if receiving:
        yield post(inputs[receiving[0]])
    for position, op in enumerate(ops):
        if position in receives_here:
            yield Action(ActionKind.WAIT, inputs[position])
            if position in next_receive:
                yield post(inputs[next_receive[position]])
        for action in _curvature_waits(op, owners, synced, rules):
            if action.target not in waited:
                waited.add(action.target)
                yield action
        yield run(op)
        yield from _curvature_launches(op, rules)
        produced = output_message(op, num_stages)
        if produced is not None and rank_of(produced.consumer) != rank:
            yield Action(ActionKind.SEND, produced, produced.channel(replica), rank_of(produced.consumer))
        stage = gradient_final.get(position)
        if stage is not None and stage in replicated:
            yield Action(ActionKind.LAUNCH, grad_collective(stage))


def _gradient_final_positions(ops: Sequence[Op]) -> dict[int, int]:
    """position -> stage whose gradient of the step is final after the op there (its last
    backward or weight gradient, or its preconditioning when that comes later)."""
    last: dict[int, int] = {}
    for position, op in enumerate(ops):
        if op.kind in GRADIENT_KINDS:
            last[op.stage] = position
    return {position: stage for stage, position in last.items()}


def _curvature_waits(op: Op, owners: dict, synced: set, rules: TaskRules) -> Iterator[Action]:
    """Refresh work waits for the sync of its input; an exchange first waits for the syncs of the
    inputs of the factors its replica did not compute (it folds them into its running state).
    The caller drops waits for a sync the rank already waited for (Shampoo's one gradient sync
    feeds both factors)."""
    if op.kind in (OpKind.INV_A, OpKind.INV_B):
        key = (op.stage, op.layer, rules.sync_for(FACTOR_OF[op.kind]))
        if key in synced:
            yield Action(ActionKind.WAIT, sync_collective(*key))
    elif op.kind is OpKind.EXCHANGE:
        inputs = dict.fromkeys(rules.sync_for(factor) for factor in rules.factors if owners.get((op.stage, op.layer, factor)) != op.pipe)
        for source in inputs:
            key = (op.stage, op.layer, source)
            if key in synced:
                yield Action(ActionKind.WAIT, sync_collective(*key))


def _curvature_launches(op: Op, rules: TaskRules) -> Iterator[Action]:
    if op.kind in (OpKind.SYNC_A, OpKind.SYNC_B):
        yield Action(ActionKind.LAUNCH, sync_collective(op.stage, op.layer, FACTOR_OF[op.kind]))
    elif op.kind is OpKind.EXCHANGE:
        for factor in rules.factors:
            yield Action(ActionKind.LAUNCH, exchange_collective(op.stage, op.layer, factor))


def _end_of_step(topology: Topology, rank: int, actions: list[Action], tied_ranks: tuple[int, ...], path: GradientPath) -> list[Action]:
    """Sends drained, gradient reductions done (PowerSGD: each followed by its Q all-reduce), tied
    weights summed, then the world reduction (the optimizer step runs when it completes); with
    ZeRO-1 the owners' parameter broadcasts last."""
    tail = [Action(ActionKind.WAIT, SendDone(a.target)) for a in actions if a.kind is ActionKind.SEND]
    reduced = [a.target for a in actions if a.kind is ActionKind.LAUNCH and a.target.kind is CollectiveKind.GRAD]
    if path.compressed:
        for collective in reduced:
            tail += [Action(ActionKind.WAIT, collective), Action(ActionKind.LAUNCH, grad_q_collective(collective.key[0]))]
        tail += [Action(ActionKind.WAIT, grad_q_collective(collective.key[0])) for collective in reduced]
    else:
        tail += [Action(ActionKind.WAIT, collective) for collective in reduced]
    if path.workers_per_layer is not None:
        for stage in sorted(c.key[0] for c in reduced):
            collective = pgrad_collective(topology, rank, stage, path.workers_per_layer)
            tail += [Action(ActionKind.LAUNCH, collective), Action(ActionKind.WAIT, collective)]
    if rank in tied_ranks:
        tail += [Action(ActionKind.LAUNCH, TIED), Action(ActionKind.WAIT, TIED)]
    tail += [Action(ActionKind.LAUNCH, STEP), Action(ActionKind.WAIT, STEP)]
    if path.sharded:
        gathers = [gather_collective(stage) for stage in sorted(c.key[0] for c in reduced)]
        tail += [Action(ActionKind.LAUNCH, c) for c in gathers] + [Action(ActionKind.WAIT, c) for c in gathers]
    return tail


def group_members(topology: Topology, tied: bool, path: GradientPath = GradientPath()) -> dict[GroupKey, tuple[int, ...]]:
    """Every communicator of a run and its global ranks (see the module docstring)."""
    tied_ranks = tied_ranks_of(topology) if tied else ()
    schedule = topology.schedule
    members: dict[GroupKey, tuple[int, ...]] = {("world",): tuple(range(topology.world_size))}
    if tied_ranks:
        members[("tied",)] = tied_ranks
    for stage in range(schedule.num_stages):
        ranks = topology.replica_ranks(stage)
        if len(ranks) > 1:
            members[("grad", stage)] = members[("curv", stage)] = ranks
            if path.workers_per_layer is not None:
                grid = GradWorkers(ranks, path.workers_per_layer)
                for block in range(grid.workers):
                    members[("pgrad", stage, block)] = grid.block_ranks(block)
    for replica in range(topology.data_parallel):
        for pipe in range(schedule.num_pipes):
            for stage in range(schedule.num_stages - 1):
                low, high = topology.rank(replica, pipe, stage), topology.rank(replica, pipe, stage + 1)
                if low != high:
                    members[("fwd", replica, pipe, stage)] = (low, high)
                    members[("bwd", replica, pipe, stage)] = (high, low)
    return members
