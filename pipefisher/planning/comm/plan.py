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
  (``gather``); with ZeRO-2/3 (`GradientPath.fsdp`) FSDP2 issues its own all-gathers inside each
  forward and backward (``unshard``) and its reduce-scatter inside the stage's last backward of
  the step (``grad``), on the same communicator; with PowerSGD (`GradientPath.compressed`) the reduction is two all-reduces, of the
  P factors (with the uncompressed tensors) and, once those are in, of the Q factors (``grad_q``).
- ``("shard", s, pipe)`` and ``("pipes", s, replica)``: ZeRO-2/3 with several pipes (Chimera):
  FSDP2 shards over each pipe's data-parallel copies of stage s (the ``unshard`` and ``grad``
  collectives are on that communicator), then each shard is summed over the pipes (``grad_pipes``).
- ``("pgrad", s, b)``: K-FAC's gradient workers (`pipefisher.planning.replicas.kaisa`): block b of stage s's
  replicas, to which its workers broadcast the preconditioned gradients (``pgrad``).
- ``("curv", s)``: stage s's curvature syncs (K-FAC factors, Shampoo's gradient) and exchanges
  of refresh results (inverses, roots, bases) over the same replicas, keyed (stage, layer, part).
- ``("help", owner, helper)``: a helped stage's rank and a rank doing part of its per-step work
  (``help_in``, ``help_out``: `pipefisher.planning.comm.helps`).
- ``("tied",)``: tied weights (first and last stage); ``("world",)``: the end-of-step reduction
  (loss, gradient norm, overflow flag) over all ranks.

Actions: RUN an op; POST the receive of a message; SEND a message right after the op that made
it; LAUNCH a collective; WAIT for a message, a send or a collective. A rank waits for an op's
input right before the op, and posts the receive of its next input right after (one receive ahead,
so transfers overlap compute). It waits for each send soon after issuing it, where
`pipefisher.planning.comm.send_waits` places the wait (once the peer has answered, or before its
next send on the channel), else at the step's end: a send in flight holds its tensor.
Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pipefisher.core.ir import GRADIENT_KINDS, Op, OpKind
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import (
    Action,
    ActionKind,
    Collective,
    CollectiveKind,
    CommOrderError,
    CommPlan,
    GradientPath,
    Message,
    STEP,
    SendDone,
    TIED,
    exchange_collective,
    fsdp_grad_collective,
    fsdp_group,
    gather_collective,
    grad_collective,
    grad_pipes_collective,
    grad_q_collective,
    input_message,
    output_message,
    pgrad_collective,
    run,
    sync_collective,
    unshard_collective,
)
from pipefisher.planning.comm.groups import group_members, tied_ranks_of
from pipefisher.planning.comm.helps import HelpActions, help_waits, helps_read_state, stage_helpers
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.comm.send_waits import SendWait, send_waits
from pipefisher.planning.plan import Plan
from pipefisher.planning.vocabulary import TaskRules


def plan_actions(
    topology: Topology,
    plan: Plan,
    tied: bool = False,
    path: GradientPath = GradientPath(),
    shared: frozenset[tuple[int, str, int]] = frozenset(),
    recompute: str = "none",
) -> CommPlan:
    """The actions of every global rank for every step of `plan`'s cycle (see the module docstring).

    `shared`: the (stage, layer, part) statistics a rank's tensor-parallel processes build in
    shares (`TaskRules.shared_when_split`); the refresh work that first reads one (its own, or
    the exchange where another replica does it) sums it over the processes.

    `tied`: the model has weights shared by the first and last stage (their gradients are summed
    over the ``("tied",)`` group at the end of every step). `path.sharded`: the owners of a
    replicated stage's parameters broadcast them after the world reduction (when the optimizer
    step has run), stage by stage in ascending order on every rank. `path.compressed`: each
    gradient reduction is followed, once waited for, by its ``grad_q`` all-reduce.
    `recompute`: the run's `model.recompute` (what its backwards all-reduce over a rank's
    tensor-parallel processes, `pipefisher.planning.comm.processes`).

    Sends are waited for where `pipefisher.planning.comm.send_waits` places them (rules (a) and
    (b)); when the replay refuses that plan, rule (a) alone, which never adds a dependency between
    the ranks (a plan that does not replay then is returned as it is, for the caller's replay to
    report).
    """
    arguments = (topology, plan, tied, path, shared, recompute)
    bounded = _plan_actions(*arguments, bounded=True)
    try:
        return replay(bounded)
    except CommOrderError:
        return _plan_actions(*arguments, bounded=False)


def _plan_actions(
    topology: Topology,
    plan: Plan,
    tied: bool,
    path: GradientPath,
    shared: frozenset[tuple[int, str, int]],
    recompute: str,
    bounded: bool,
) -> CommPlan:
    """`plan_actions` with the send waits of rules (a) and (b) (`bounded`) or (a) alone."""
    schedule = plan.schedule
    num_stages = schedule.num_stages
    owners = inverse_owners(plan)
    rules = plan.task_rules() if plan.curvature_ops() else None
    synced = {(op.stage, op.layer, op.part) for op in plan.curvature_ops() if op.kind is OpKind.SYNC}
    tied_ranks = tied_ranks_of(topology) if tied else ()
    replicated = {stage for stage in range(num_stages) if len(topology.replica_ranks(stage)) > 1}
    helpers, help_state = stage_helpers(plan), helps_read_state(plan)
    steps: list[tuple[tuple[Action, ...], ...]] = []
    #: per rank, the syncs it has waited for in the cycle so far (a sync feeds several ops)
    waited: list[set[Collective]] = [set() for _ in range(topology.world_size)]
    for index, step in enumerate(plan.steps):
        last_step = index == len(plan.steps) - 1
        waits = send_waits(step, schedule.placement, num_stages, bounded)
        ranks = []
        for rank in range(topology.world_size):
            replica = topology.replica_of(rank)
            ops = step[topology.pipeline_rank(rank)]
            slots = waits[topology.pipeline_rank(rank)]
            helps = HelpActions(topology, ops, rank, replica, helpers, help_state and index == 0)
            actions = list(
                _op_actions(
                    topology,
                    ops,
                    replica,
                    rank,
                    owners,
                    synced,
                    replicated,
                    rules,
                    waited[rank],
                    slots,
                    helps,
                    path.fsdp,
                )
            )
            actions += _end_of_step(topology, rank, actions, tied_ranks, path)
            if last_step:
                exchanges = [
                    a.collective
                    for s in steps
                    for a in s[rank]
                    if a.kind is ActionKind.LAUNCH and a.collective.kind is CollectiveKind.EXCHANGE
                ]
                exchanges += [
                    a.collective
                    for a in actions
                    if a.kind is ActionKind.LAUNCH and a.collective.kind is CollectiveKind.EXCHANGE
                ]
                actions += [Action(ActionKind.WAIT, c) for c in exchanges]
            ranks.append(tuple(actions))
        steps.append(tuple(ranks))
    members = group_members(topology, tied, path, helpers=bool(helpers))
    return CommPlan(topology, tuple(steps), members, tensor_reading_ops(plan, shared, owners), recompute)


def tensor_reading_ops(
    plan: Plan, shared: frozenset[tuple[int, str, int]], owners: dict[tuple[int, str, int], int]
) -> frozenset[Op]:
    """The ops of `plan` that sum a `shared` statistic over the rank's tensor-parallel processes:
    its refresh work, or the exchange of a replica that does not do it (it folds the statistic)."""
    if not shared:
        return frozenset()
    found = set()
    for op in plan.curvature_ops():
        if op.kind is OpKind.REFRESH and (op.stage, op.layer, op.part) in shared:
            found.add(op)
        elif op.kind is OpKind.EXCHANGE and any(
            (op.stage, op.layer, part) in shared and owner != op.pipe
            for (stage, layer, part), owner in owners.items()
            if (stage, layer) == (op.stage, op.layer)
        ):
            found.add(op)
    return frozenset(found)


def inverse_owners(plan: Plan) -> dict[tuple[int, str, int], int]:
    """(stage, layer, part) -> the pipe whose rank does that part's refresh work."""
    owners: dict[tuple[int, str, int], int] = {}
    for op in plan.curvature_ops():
        if op.kind is OpKind.REFRESH and op.layer is not None and op.part is not None:
            owners.setdefault((op.stage, op.layer, op.part), op.pipe)
    return owners


def _op_actions(
    topology: Topology,
    ops: Sequence[Op],
    replica: int,
    rank: int,
    owners: dict,
    synced: set,
    replicated: set[int],
    rules: TaskRules | None,
    waited: set[Collective],
    slots: dict[int, SendWait | None],
    helps: HelpActions,
    fsdp: bool = False,
) -> Iterator[Action]:
    """One rank's actions for its ops of a step; `slots`: where it waits for the send of the op at
    each position (`send_waits`; None: at the step's end, `_end_of_step`). `fsdp` (ZeRO-2/3): every
    forward and backward of a replicated stage is preceded by FSDP2's all-gathers (``unshard``, launched and waited for at
    once: the op blocks on them), and the stage's last backward of the step carries its
    reduce-scatter (``grad``, launched before the op, waited for right after it), even when a
    preconditioning op follows: that op reads the reduced gradients whole, so it is preceded by
    its own all-gathers of them (``unshard`` of the op); both on the stage's FSDP communicator
    (`fsdp_group`). With several pipes the shards are then summed over the pipes (``grad_pipes``,
    launched right after the reduce-scatter; a preconditioning op waits for it first, since a
    method's op need not be linear in the gradient (Muon's is not); else waited for at the step's
    end)."""
    num_stages, pipes = topology.schedule.num_stages, topology.schedule.num_pipes

    def rank_of(op: Op) -> int:
        return topology.rank(replica, op.pipe, op.stage)

    def post(message: Message) -> Action:
        return Action(ActionKind.POST, message, message.channel(replica), rank_of(message.producer))

    inputs = [input_message(op, num_stages) for op in ops]
    received = {
        i: message for i, message in enumerate(inputs) if message is not None and rank_of(message.producer) != rank
    }
    receiving = list(received)
    next_receive = dict(zip(receiving, receiving[1:]))
    receives_here = set(receiving)
    gradient_final = _gradient_final_positions(ops)
    #: where each stage's gradient is final before its preconditioning (its helpers' inputs are ready)
    handed = _gradient_final_positions(ops, _HANDED_KINDS)
    #: ZeRO-2/3: where FSDP2 reduce-scatters each stage's gradient (its last backward)
    scattered = _gradient_final_positions(ops, _FSDP_GRADIENT_KINDS) if fsdp else {}
    send_done = _send_done_at(ops, slots, num_stages)
    if receiving:
        yield post(received[receiving[0]])
    for position, op in enumerate(ops):
        if position in receives_here:
            yield Action(ActionKind.WAIT, received[position])
            if position in next_receive:
                yield post(received[next_receive[position]])
        yield from send_done.get(SendWait(position), ())
        for action in _curvature_waits(op, owners, synced, rules):
            if action.collective not in waited:
                waited.add(action.collective)
                yield action
        stage = gradient_final.get(position)
        sharded = fsdp and op.stage in replicated and op.kind in (OpKind.FORWARD, OpKind.BACKWARD)
        group = fsdp_group(op.stage, op.pipe, pipes)
        if fsdp and pipes > 1 and op.stage in replicated and op.kind is OpKind.PRECONDITION:
            yield Action(ActionKind.WAIT, grad_pipes_collective(op.stage, replica))
        if fsdp and op.stage in replicated and (sharded or op.kind is OpKind.PRECONDITION):
            gathers = unshard_collective(op.stage, op, group)
            yield from (Action(ActionKind.LAUNCH, gathers), Action(ActionKind.WAIT, gathers))
        scatter = sharded and scattered.get(position) is not None
        if scatter:
            yield Action(ActionKind.LAUNCH, fsdp_grad_collective(op.stage, group))
        yield from helps.before(position)
        yield run(op)
        yield from helps.after(position, handed.get(position))
        if scatter:
            yield Action(ActionKind.WAIT, fsdp_grad_collective(op.stage, group))
            if pipes > 1:
                yield Action(ActionKind.LAUNCH, grad_pipes_collective(op.stage, replica))
        yield from _curvature_launches(op, rules)
        yield from send_done.get(SendWait(position, after_run=True), ())
        produced = output_message(op, num_stages)
        if produced is not None and rank_of(produced.consumer) != rank:
            yield Action(ActionKind.SEND, produced, produced.channel(replica), rank_of(produced.consumer))
        if stage is not None and stage in replicated and not fsdp:
            yield Action(ActionKind.LAUNCH, grad_collective(stage))


def _send_done_at(
    ops: Sequence[Op], slots: dict[int, SendWait | None], num_stages: int
) -> dict[SendWait, list[Action]]:
    """Slot -> the waits for the sends placed there (`slots`: sender's position -> its slot)."""
    found: dict[SendWait, list[Action]] = {}
    for sender, slot in slots.items():
        message = output_message(ops[sender], num_stages)
        if slot is not None and message is not None:
            found.setdefault(slot, []).append(Action(ActionKind.WAIT, SendDone(message)))
    return found


#: the ops after whose last one a stage's gradient is whole before its preconditioning: ZeRO-2/3
#: reduce-scatters there (FSDP2 does it inside the backward; a preconditioning op after it works
#: on the reduced gradient), and a helped stage hands its helpers their inputs
_FSDP_GRADIENT_KINDS = _HANDED_KINDS = GRADIENT_KINDS - {OpKind.PRECONDITION}


def _gradient_final_positions(ops: Sequence[Op], kinds: frozenset[OpKind] = GRADIENT_KINDS) -> dict[int, int]:
    """position -> stage whose gradient of the step is final after the op there: its last op of
    `kinds` (by default its last backward or weight gradient, or its preconditioning when that
    comes later; before the reduction, which then follows it)."""
    last: dict[int, int] = {}
    for position, op in enumerate(ops):
        if op.kind in kinds:
            last[op.stage] = position
    return {position: stage for stage, position in last.items()}


def _curvature_waits(op: Op, owners: dict, synced: set, rules: TaskRules | None) -> Iterator[Action]:
    """Refresh work waits for the sync of its input; an exchange first waits for the syncs of the
    inputs of the parts its replica did not refresh (it folds them into its running state).
    The caller drops waits for a sync the rank already waited for (Shampoo's one gradient sync
    feeds both parts)."""
    layer = op.layer
    if layer is None or rules is None:  # not curvature work
        return
    if op.kind is OpKind.REFRESH and op.part is not None:
        source = rules.sync_for(op.part)
        if source is not None and (op.stage, layer, source) in synced:
            yield Action(ActionKind.WAIT, sync_collective(op.stage, layer, source))
    elif op.kind is OpKind.EXCHANGE:
        inputs = dict.fromkeys(
            rules.sync_for(part) for part in rules.parts if owners.get((op.stage, layer, part)) != op.pipe
        )
        for source in inputs:
            if source is not None and (op.stage, layer, source) in synced:
                yield Action(ActionKind.WAIT, sync_collective(op.stage, layer, source))


def _curvature_launches(op: Op, rules: TaskRules | None) -> Iterator[Action]:
    layer = op.layer
    if layer is None or rules is None:  # not curvature work
        return
    if op.kind is OpKind.SYNC and op.part is not None:
        yield Action(ActionKind.LAUNCH, sync_collective(op.stage, layer, op.part))
    elif op.kind is OpKind.EXCHANGE:
        for part in rules.parts:
            yield Action(ActionKind.LAUNCH, exchange_collective(op.stage, layer, part))


def _end_of_step(
    topology: Topology, rank: int, actions: list[Action], tied_ranks: tuple[int, ...], path: GradientPath
) -> list[Action]:
    """The sends not waited for earlier drained, gradient reductions done (PowerSGD: each followed
    by its Q all-reduce), tied weights summed, then the world reduction (the optimizer step runs
    when it completes); with ZeRO-1 the owners' parameter broadcasts last."""
    early = {a.target for a in actions if a.kind is ActionKind.WAIT and isinstance(a.target, SendDone)}
    tail = [
        Action(ActionKind.WAIT, done)
        for a in actions
        if a.kind is ActionKind.SEND and (done := SendDone(a.message)) not in early
    ]
    reduced = [
        a.collective
        for a in actions
        if a.kind is ActionKind.LAUNCH and a.collective.kind is CollectiveKind.GRAD and not path.fsdp
    ]
    if path.compressed:
        for collective in reduced:
            tail += [
                Action(ActionKind.WAIT, collective),
                Action(ActionKind.LAUNCH, grad_q_collective(collective.key[0])),
            ]
        tail += [Action(ActionKind.WAIT, grad_q_collective(collective.key[0])) for collective in reduced]
    else:
        tail += [Action(ActionKind.WAIT, collective) for collective in reduced]
    pipe_sums = [
        a.collective for a in actions if a.kind is ActionKind.LAUNCH and a.collective.kind is CollectiveKind.GRAD_PIPES
    ]
    waited = {a.collective for a in actions if a.kind is ActionKind.WAIT and isinstance(a.target, Collective)}
    tail += [Action(ActionKind.WAIT, collective) for collective in pipe_sums if collective not in waited]
    tail += help_waits(actions)
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
