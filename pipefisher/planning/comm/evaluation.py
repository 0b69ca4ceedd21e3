"""The forward-only pass of held-out evaluation, derived from the run's own schedule.

Evaluation runs no second, hand-written schedule: every rank runs the forward ops of its training
op list, in their order, and nothing else (no backward, weight gradient, curvature work or
reduction of gradients). A pass of M micro-batches per replica repeats that forward sweep in
rounds of the schedule's N micro-batches: round j renames micro-batch m to j·N + m, and the last
round keeps the micro-batches m below what is left (all stages of each). Its actions come from
`pipefisher.planning.comm.plan.plan_actions` like a training step's: forwards with their sends and
receives, the sends waited for, then one all-reduce over ``("world",)`` that sums the losses.

Why this is correct under NCCL's in-order rule by construction: the forwards of one micro-batch
depend only on forwards (stage s − 1 of the same micro-batch), so dropping every other op from
a schedule that runs leaves lists that run (the training order restricted to forwards is an
order of them), and on each ``("fwd", replica, pipe, s)`` communicator both ends issue the kept
messages in the order the training step issues them, which the replay already matched; keeping
whole micro-batches keeps both ends of every message. Rounds are concatenated: round j + 1's
messages follow round j's on both ends of every communicator. No other communicator carries
anything but the final all-reduce, which every process issues last. `evaluation_actions` replays
the result (`pipefisher.planning.comm.replay`) all the same, before anything runs. Pure Python:
no torch.
"""

from __future__ import annotations

from pipefisher.core.ir import Op, OpKind, Schedule
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import CommPlan
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.plan import Plan


def forward_sweep(schedule: Schedule, micro_batches: int) -> Schedule:
    """The evaluation schedule of `micro_batches` micro-batches per replica: every rank's forward
    ops of `schedule` in their order, in rounds of `schedule.num_micro_batches` (see the module
    docstring); same placement, stages and pipes. ValueError for fewer than one micro-batch."""
    if micro_batches < 1:
        raise ValueError(f"an evaluation pass needs at least one micro-batch per replica, got {micro_batches}")
    per_round = schedule.num_micro_batches
    ranks = []
    for ops in schedule.ranks:
        forwards = [op for op in ops if op.kind is OpKind.FORWARD]
        swept: list[Op] = []
        for start in range(0, micro_batches, per_round):
            kept = micro_batches - start
            swept += [
                Op(OpKind.FORWARD, op.stage, start + op.micro_batch, op.pipe)
                for op in forwards
                if op.micro_batch is not None and op.micro_batch < kept
            ]
        ranks.append(tuple(swept))
    return Schedule(
        name=f"{schedule.name} evaluation",
        num_stages=schedule.num_stages,
        num_micro_batches=micro_batches,
        placement=dict(schedule.placement),
        ranks=tuple(ranks),
        num_pipes=schedule.num_pipes,
        params=dict(schedule.params),
    )


def evaluation_actions(topology: Topology, micro_batches: int) -> CommPlan:
    """Every rank's actions of one evaluation pass of `micro_batches` micro-batches per replica
    over `topology` (the training run's), as a one-step plan on the topology of the sweep
    (`forward_sweep`; its `global_micro_batch` numbers the pass's micro-batches replica by
    replica, 0 .. replicas·micro_batches − 1); replayed under NCCL's rule, CommOrderError if it
    would not complete (tensor-parallel all-reduces inside the forwards included)."""
    sweep = forward_sweep(topology.schedule, micro_batches)
    swept = Topology(sweep, topology.data_parallel, topology.tensor_parallel)
    return replay(plan_actions(swept, Plan(schedule=sweep, steps=(sweep.ranks,))), name=sweep.name)
