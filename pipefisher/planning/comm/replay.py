"""Replay of every rank's issue order under NCCL's rules, before anything runs.

The model (what NCCL guarantees and no more): issuing a receive, a send or a collective never
blocks the rank; on each communicator a rank's operations complete one after another in issue
order; an operation completes once it is at the head of every participant's queue on that
communicator (a send and the matching receive, or every member's same collective); a WAIT blocks
its rank until its operation has completed. The k-th send from a to b on a communicator pairs
with the k-th receive at b from a, and they must carry the same message; the k-th collectives of
all members must be the same call. `replay` raises CommOrderError with the grid of actions
(the stuck or mismatched ones marked) when a plan deadlocks, mismatches or leaves an operation
that never completes. Pure Python: no torch.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Hashable, Sequence

from pipefisher.core.ir import format_grid
from pipefisher.planning.comm.actions import Action, ActionKind, CommOrderError, CommPlan, GroupKey, SendDone
from pipefisher.planning.comm.processes import process_programs

#: an operation as all its participants see it: ("p2p", group, src, dst, k) or ("coll", group, k)
Joint = tuple


def _handle(action: Action) -> Hashable:
    """What a WAIT names: the message of a receive, the `SendDone` of a send, or a collective."""
    if action.kind is ActionKind.SEND:
        return SendDone(action.message)
    return action.target


class _Replay:
    def __init__(self, programs: Sequence[Sequence[Action]], members: dict[GroupKey, tuple[int, ...]], name: str):
        self.programs, self.members, self.name = programs, members, name
        self.pc = [0] * len(programs)
        self.queues: dict[tuple[GroupKey, int], deque[Joint]] = defaultdict(deque)
        self.counts: dict[tuple, int] = defaultdict(int)
        self.issued: dict[Joint, dict[int, tuple[int, object]]] = defaultdict(dict)
        self.joint_of: dict[tuple[int, Hashable], Joint] = {}
        self.done: set[Joint] = set()
        self.waiting: dict[Joint, list[int]] = defaultdict(list)
        self.ready: deque[int] = deque(range(len(programs)))

    # -- issuing -------------------------------------------------------------------------------
    def _participants(self, joint: Joint) -> tuple[int, ...]:
        if joint[0] == "p2p":
            return (joint[2], joint[3])
        return self.members[joint[1]]

    def _issue(self, rank: int, position: int, action: Action) -> None:
        key: tuple
        if action.kind is ActionKind.LAUNCH:
            group = action.collective.group
            if rank not in self.members.get(group, ()):
                raise self._error(
                    f"rank {rank} launches {action.target} on {group}, a group it is not in", [(rank, position)]
                )
            key = ("coll", group, rank)
            joint: Joint = ("coll", group, self.counts[key])
        else:
            assert action.group is not None, action  # POST and SEND name their communicator
            group = action.group
            src, dst = (rank, action.peer) if action.kind is ActionKind.SEND else (action.peer, rank)
            key = (action.kind, group, src, dst)
            joint = ("p2p", group, src, dst, self.counts[key])
        self.counts[key] += 1
        self.issued[joint][rank] = (position, action.target)
        self.queues[(group, rank)].append(joint)
        self.joint_of[(rank, _handle(action))] = joint
        self._settle(joint)

    # -- completing ----------------------------------------------------------------------------
    def _complete(self, joint: Joint) -> bool:
        if joint in self.done:
            return False
        group = joint[1]
        participants = self._participants(joint)
        issued = self.issued[joint]
        if len(issued) < len(participants) or any(self.queues[(group, r)][0] != joint for r in participants):
            return False
        targets = {str(target) for _, target in issued.values()}
        if len(targets) > 1:
            what = "; ".join(f"rank {r} has {target}" for r, (_, target) in sorted(issued.items()))
            raise self._error(f"mismatch on {_group_name(group)}: {what}", [(r, p) for r, (p, _) in issued.items()])
        self.done.add(joint)
        for rank in participants:
            self.queues[(group, rank)].popleft()
        self.ready.extend(self.waiting.pop(joint, ()))
        return True

    def _settle(self, joint: Joint) -> None:
        """Complete `joint` and, in turn, whatever it unblocks on its communicator."""
        work = [joint]
        while work:
            current = work.pop()
            if self._complete(current):
                for rank in self._participants(current):
                    queue = self.queues[(current[1], rank)]
                    if queue:
                        work.append(queue[0])

    # -- running -------------------------------------------------------------------------------
    def _advance(self, rank: int) -> None:
        program = self.programs[rank]
        while self.pc[rank] < len(program):
            action = program[self.pc[rank]]
            if action.kind is ActionKind.WAIT:
                joint = self.joint_of.get((rank, action.target))
                if joint is None:
                    raise self._error(
                        f"rank {rank} waits for {action.target}, which it never issued", [(rank, self.pc[rank])]
                    )
                if joint not in self.done:
                    self.waiting[joint].append(rank)
                    return
            elif action.kind is not ActionKind.RUN:
                self._issue(rank, self.pc[rank], action)
            self.pc[rank] += 1

    def run(self) -> None:
        while self.ready:
            self._advance(self.ready.popleft())
        stuck = [(rank, pc) for rank, pc in enumerate(self.pc) if pc < len(self.programs[rank])]
        if stuck:
            reasons = [self._why(rank, pc) for rank, pc in stuck]
            raise self._error("deadlock under NCCL's in-order rule: " + "; ".join(reasons), stuck)
        leftover = [(group, rank, queue[0]) for (group, rank), queue in self.queues.items() if queue]
        if leftover:
            group, rank, joint = min(leftover, key=str)
            position, target = self.issued[joint][rank]
            raise self._error(
                f"rank {rank} issues {target} on {_group_name(group)}, which never completes", [(rank, position)]
            )

    def _why(self, rank: int, pc: int) -> str:
        action = self.programs[rank][pc]
        joint = self.joint_of[(rank, action.target)]
        group = joint[1]
        for other in self._participants(joint):
            if other not in self.issued[joint]:
                return f"rank {rank} waits for {action.target}, which rank {other} has not issued"
            head = self.queues[(group, other)][0]
            if head != joint:
                position, _ = self.issued[head][other]
                blocker = self.programs[other][position]
                return f"rank {rank} waits for {action.target}, queued on rank {other} behind its {blocker} on {_group_name(group)}"
        return f"rank {rank} waits for {action.target}"

    def _error(self, message: str, marks: list[tuple[int, int]]) -> CommOrderError:
        return CommOrderError(f"{self.name}: {message}\n{format_grid(self.programs, marks)}")


def _group_name(group: GroupKey) -> str:
    return "/".join(str(part) for part in group)


def replay(plan: CommPlan, name: str = "plan") -> CommPlan:
    """Check that every process's actions over one cycle (a rank's, on its shard's communicators,
    with the tensor-parallel all-reduces of `pipefisher.planning.comm.processes`) complete under
    NCCL's rules; return `plan` or raise CommOrderError (see the module docstring)."""
    replay_programs(*process_programs(plan), name)
    return plan


def replay_programs(
    programs: Sequence[Sequence[Action]], members: dict[GroupKey, tuple[int, ...]], name: str = "plan"
) -> None:
    """Check that the actions of every process (`programs[p]`, on communicators of the processes
    `members` names) complete under NCCL's rules, or raise CommOrderError."""
    _Replay(programs, members, name).run()
