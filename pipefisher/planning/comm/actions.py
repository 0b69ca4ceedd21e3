"""The vocabulary of communication planning: messages between stages, collectives and their
kinds, the actions a rank issues, the gradient path of a replicated stage, and a `CommPlan` of
every rank's actions. Pure Python: no torch."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from enum import Enum

from pipefisher.core.ir import Op, OpKind, ScheduleError
from pipefisher.core.topology import Topology
from pipefisher.planning.replicas.kaisa import GradWorkers

#: a communicator by purpose, e.g. ("grad", stage); see `pipefisher.planning.comm.plan`
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


def message_ends(op: Op, num_stages: int) -> tuple[bool, int | None]:
    """The point-to-point rule: whether `op` consumes a message from the neighbouring stage, and the
    stage its output goes to (None: no message). Forwards flow from stage to stage + 1,
    backwards to stage - 1; other ops send and receive nothing."""
    stage = op.stage
    if op.kind is OpKind.FORWARD:
        return stage > 0, stage + 1 if stage < num_stages - 1 else None
    if op.kind is OpKind.BACKWARD:
        return stage < num_stages - 1, stage - 1 if stage > 0 else None
    return False, None


def input_message(op: Op, num_stages: int) -> Message | None:
    """The message `op` consumes, if any (`message_ends`)."""
    return Message(op) if message_ends(op, num_stages)[0] else None


def output_message(op: Op, num_stages: int) -> Message | None:
    """The message `op` produces for the neighbouring stage, if any (`message_ends`)."""
    to = message_ends(op, num_stages)[1]
    return None if to is None else Message(Op(op.kind, to, op.micro_batch, op.pipe))


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
    #: ZeRO-2/3: the all-gathers inside one op, on the stage's FSDP communicator (`fsdp_group`):
    #: FSDP2's of the parameters inside a forward or backward (none where they are gathered
    #: already), a method's of the reduced gradients it reads whole inside its preconditioning
    UNSHARD = "unshard"
    #: ZeRO-2/3 with several pipes (Chimera): each gradient shard summed over the stage's copies in
    #: the other pipes, after FSDP2's reduce-scatter within the pipe
    GRAD_PIPES = "grad_pipes"
    #: a helped stage's layers' refresh results in use (K-FAC's inverses, Shampoo's roots), broadcast from its rank
    #: to a helper at the start of every cycle (methods with refresh work only)
    HELP_STATE = "help_state"
    #: a helped stage's layer inputs of the step, broadcast from its rank to a helper (`OpKind.HELP`)
    HELP_IN = "help_in"
    #: the helper's results of those layers, broadcast back to the stage's rank
    HELP_OUT = "help_out"
    #: the sum of a tied weight's gradient over the stages that hold copies
    TIED = "tied"
    #: the world reduction of the step's loss, norm and flags (the optimizer step follows it)
    STEP = "step"
    #: the all-reduces of an op's partial results over its rank's tensor-parallel processes
    TENSOR = "tensor"


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective call on `group`: its kind and what it is of (e.g. (stage, layer, part)
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

    def __str__(self) -> str:
        return f"send:{self.message}"


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
    target: Op | Message | Collective | SendDone
    group: GroupKey | None = None
    peer: int | None = None

    @property
    def op(self) -> Op:
        """The target of a RUN."""
        if not isinstance(self.target, Op):
            raise TypeError(f"{self.kind.value} action on {self.target}: not an op")
        return self.target

    @property
    def message(self) -> Message:
        """The target of a POST, a SEND or a receive's WAIT."""
        if not isinstance(self.target, Message):
            raise TypeError(f"{self.kind.value} action on {self.target}: not a message")
        return self.target

    @property
    def collective(self) -> Collective:
        """The target of a LAUNCH or a collective's WAIT."""
        if not isinstance(self.target, Collective):
            raise TypeError(f"{self.kind.value} action on {self.target}: not a collective")
        return self.target

    @property
    def link(self) -> tuple[GroupKey, int]:
        """The communicator and the other end's global rank of a POST or a SEND."""
        if self.group is None or self.peer is None:
            raise TypeError(f"{self.kind.value} action on {self.target}: no communicator and peer")
        return self.group, self.peer

    def __str__(self) -> str:
        if self.kind is ActionKind.RUN:
            return str(self.target)
        prefix = {ActionKind.POST: "recv:", ActionKind.SEND: "send:", ActionKind.LAUNCH: "+", ActionKind.WAIT: "w:"}[
            self.kind
        ]
        return prefix + str(self.target)


def run(op: Op) -> Action:
    return Action(ActionKind.RUN, op)


class Reduction(str, Enum):
    """How a replicated stage's gradient is reduced over its replicas (one of them per run)."""

    #: every replica gets the whole sum
    ALL_REDUCE = "all-reduce"
    #: ZeRO-1: reduced to the parameters' owners, who broadcast the updated parameters after the
    #: world reduction (``gather``)
    SHARDED = "zero-1"
    #: PowerSGD: an all-reduce of the P factors, then, once it is in, one of the Q factors (``grad_q``)
    COMPRESSED = "powersgd"
    #: ZeRO-2 (FSDP2, parameters kept gathered through the step): FSDP's all-gathers inside the
    #: ops (``unshard``), its reduce-scatter inside the stage's last backward of the step (``grad``)
    FSDP_GRADIENTS = "zero-2"
    #: ZeRO-3 (FSDP2, parameters resharded after every forward and backward): as ZeRO-2
    FSDP_PARAMETERS = "zero-3"


#: optimizer.zero -> its gradient path (0: none)
ZERO_REDUCTIONS = {
    0: Reduction.ALL_REDUCE,
    1: Reduction.SHARDED,
    2: Reduction.FSDP_GRADIENTS,
    3: Reduction.FSDP_PARAMETERS,
}


def workers_problem(reduction: Reduction) -> str:
    """Why gradient workers (`GradientPath.workers_per_layer`) cannot follow `reduction`; "" when
    they can. Workers need every replica's whole reduced gradient: the one place this rule lives."""
    if reduction is Reduction.SHARDED:
        return "gradient workers need every replica's reduced gradient, ZeRO-1 reduces to owners"
    if reduction in (Reduction.FSDP_GRADIENTS, Reduction.FSDP_PARAMETERS):
        return "gradient workers need every replica's whole reduced gradient, ZeRO-2/3 leave each replica a shard"
    return ""


@dataclass(frozen=True)
class GradientPath:
    """How a replicated stage's gradient travels at the end of a step: its `reduction`, and
    `workers_per_layer` G (gradient workers, fewer than the stage's replicas: once reduced, they
    precondition their layers and broadcast them within their block, ``pgrad``; None: every
    replica preconditions before the reduction). ValueError where `workers_problem` refuses them."""

    reduction: Reduction = Reduction.ALL_REDUCE
    workers_per_layer: int | None = None

    def __post_init__(self) -> None:
        if self.workers_per_layer is not None and (problem := workers_problem(self.reduction)):
            raise ValueError(problem)

    @property
    def sharded(self) -> bool:
        return self.reduction is Reduction.SHARDED

    @property
    def compressed(self) -> bool:
        return self.reduction is Reduction.COMPRESSED

    @property
    def fsdp(self) -> bool:
        """ZeRO-2/3: FSDP2 issues the stage's collectives inside its forwards and backwards."""
        return self.reduction in (Reduction.FSDP_GRADIENTS, Reduction.FSDP_PARAMETERS)


@dataclass(frozen=True)
class CommPlan:
    """`steps[j][rank]`: the actions of global `rank` in step j of the cycle; `members[group]`:
    the global ranks of every communicator the actions use; `tensor_ops`: the curvature ops that,
    besides every forward and backward, sum a statistic over their rank's tensor-parallel
    processes; `recompute`: the run's `model.recompute`, whose recomputed forwards may all-reduce
    again inside the backwards (`pipefisher.planning.comm.processes`)."""

    topology: Topology
    steps: tuple[tuple[tuple[Action, ...], ...], ...]
    members: dict[GroupKey, tuple[int, ...]]
    tensor_ops: frozenset[Op] = frozenset()
    recompute: str = "none"

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
                        launched_by[action.collective].add(other)
        open_: dict[Collective, None] = {}  # launched, not yet waited for: in launch order
        for earlier in self.steps[:step]:
            for action in earlier[rank]:
                if action.kind is ActionKind.LAUNCH:
                    open_[action.collective] = None
                elif action.kind is ActionKind.WAIT and isinstance(action.target, Collective):
                    open_.pop(action.target, None)
        complete: list[Collective] = []
        incomplete: list[Collective] = []
        for collective in open_:
            everyone = launched_by[collective] >= set(self.members[collective.group])
            (complete if everyone else incomplete).append(collective)
        return complete, incomplete


def sync_collective(stage: int, layer: str, part: int) -> Collective:
    return Collective(CollectiveKind.SYNC, ("curv", stage), (stage, layer, part))


def exchange_collective(stage: int, layer: str, part: int) -> Collective:
    return Collective(CollectiveKind.EXCHANGE, ("curv", stage), (stage, layer, part))


def grad_collective(stage: int) -> Collective:
    return Collective(CollectiveKind.GRAD, ("grad", stage), (stage,))


def grad_q_collective(stage: int) -> Collective:
    """PowerSGD's all-reduce of stage `stage`'s Q factors (after the one of its P factors)."""
    return Collective(CollectiveKind.GRAD_Q, ("grad", stage), (stage,))


def pgrad_collective(topology: Topology, rank: int, stage: int, workers: int) -> Collective:
    """The broadcasts of stage `stage`'s preconditioned gradients within `rank`'s block."""
    grid = GradWorkers(topology.replica_ranks(stage), workers)
    return Collective(CollectiveKind.PGRAD, ("pgrad", stage, grid.block(rank)), (stage,))


def help_collective(kind: CollectiveKind, owner: int, helper: int, stage: int) -> Collective:
    """`kind` (HELP_STATE, HELP_IN or HELP_OUT) of stage `stage`, held by global rank `owner`, with `helper`,
    on their communicator ``("help", owner, helper)``."""
    return Collective(kind, ("help", owner, helper), (stage,))


def gather_collective(stage: int) -> Collective:
    """ZeRO-1's broadcast of stage `stage`'s updated parameters from their owners."""
    return Collective(CollectiveKind.GATHER, ("grad", stage), (stage,))


def fsdp_group(stage: int, pipe: int, pipes: int) -> GroupKey:
    """ZeRO-2/3: the communicator FSDP2 shards stage `stage`'s copy in `pipe` over: its
    data-parallel replicas in that pipe (``("shard", stage, pipe)``) when the schedule has `pipes`
    > 1 (their copies run the same ops at the same times; the other pipes' do not), else all of
    the stage's replicas (``("grad", stage)``)."""
    return ("shard", stage, pipe) if pipes > 1 else ("grad", stage)


def unshard_collective(stage: int, op: Op, group: GroupKey | None = None) -> Collective:
    """ZeRO-2/3: the all-gathers inside `op` on `group` (`fsdp_group`; default the stage's ``grad``
    communicator): FSDP2's of stage `stage`'s parameters (a forward or backward), or the method's
    of the reduced gradients it reads whole (`pipefisher.runtime.primitives.sharding.whole_gradient`;
    a preconditioning op). The executor launches nothing for it: the op issues them; the plan
    names them so that the replay checks their order."""
    return Collective(CollectiveKind.UNSHARD, group or ("grad", stage), (stage, str(op)))


def fsdp_grad_collective(stage: int, group: GroupKey) -> Collective:
    """ZeRO-2/3: FSDP2's reduce-scatter of stage `stage`'s gradients on `group` (`fsdp_group`),
    inside the op it is launched before."""
    return Collective(CollectiveKind.GRAD, group, (stage,))


def grad_pipes_collective(stage: int, replica: int) -> Collective:
    """ZeRO-2/3 with several pipes: the all-reduce of data-parallel `replica`'s gradient shards of
    stage `stage` over the stage's copies in every pipe."""
    return Collective(CollectiveKind.GRAD_PIPES, ("pipes", stage, replica), (stage,))


TIED = Collective(CollectiveKind.TIED, ("tied",))
STEP = Collective(CollectiveKind.STEP, ("world",))
