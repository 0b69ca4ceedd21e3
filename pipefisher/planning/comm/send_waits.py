"""Where a rank waits for each of its point-to-point sends: soon after issuing it, not at the step's end.

A send in flight holds its tensor until the rank waits for it (`pipefisher.runtime.pipeline.executor`),
so the wait decides how long a boundary activation or gradient stays alive. Under NCCL's rule a
wait for a send blocks until the peer has matched it: the peer has posted the receive, and every
earlier operation on the communicator has completed. On a ``("fwd" | "bwd", ...)`` channel both
ends issue their messages in micro-batch order, so once the peer has posted the receive of
message m, m completes (the earlier messages were posted before it, and sent before m).

The rule, per message m that op i of pipeline rank R sends to pipeline rank Q (the earlier of):

(a) *heard back*: right after R's wait for the first later input j > i that R receives from Q
    and that Q sends after posting the receive of m (Q posts its receives one ahead, right after
    its wait for the input before; it sends right after the producing op). When R has that input,
    Q has issued its send, hence posted m's receive before it: the wait never blocks for long and
    adds no dependency between the ranks (any plan that replays with the waits at the step's end
    replays with these).
(b) *bounded*: right after R runs the op that produces the next message on m's channel, before
    R issues its send; so at most one send per channel is in flight between two of R's sends on
    it. This wait blocks R until Q has posted m's receive, a dependency the replay
    (`pipefisher.planning.comm.replay`) checks; `pipefisher.planning.comm.plan.plan_actions`
    falls back to (a) alone for a plan it refuses (no registered schedule's plan needs it; the
    memory model, `pipefisher.planning.memory.activations`, counts with (a) and (b)).

A message with neither (the last on its channel, no later input from its peer) is waited for at
the step's end. Data-parallel replicas and tensor-parallel processes run the same op lists on
their own communicators, so the waits are derived per pipeline rank. Pure Python: no torch.
"""

from __future__ import annotations

import weakref
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipefisher.core.ir import Op, Schedule
from pipefisher.planning.comm.actions import Message, input_message, output_message


@dataclass(frozen=True, slots=True, order=True)
class SendWait:
    """Where the rank waits for a send: around its op at `position` (in the rank's op list of the
    step), before the op runs (right after its input is in; `after_run` False) or right after it
    runs (before the op's own send; True). Ordered: the earlier slot is the smaller."""

    position: int
    after_run: bool = False


@dataclass(frozen=True)
class _Rank:
    """One pipeline rank's point-to-point traffic of a step, by position in its op list."""

    #: position -> the message the op there sends to another rank
    sends: dict[int, Message]
    #: peer rank -> positions of the ops that receive their input from it, ascending
    heard_from: dict[int, list[int]]
    #: position -> the message the op there receives from another rank
    receives: dict[int, Message]
    #: message received -> position of the op before which its receive is posted (-1: first thing)
    posted_before: dict[Message, int]


def _traffic(ranks: Sequence[Sequence[Op]], placement: Mapping[tuple[int, int], int], stages: int) -> list[_Rank]:
    """Every pipeline rank's sends and receives (a message is received from the rank that makes it)."""
    outputs = [[(position, output_message(op, stages)) for position, op in enumerate(ops)] for ops in ranks]
    made_by = {message: rank for rank, made in enumerate(outputs) for _, message in made if message is not None}
    traffic = []
    for rank, ops in enumerate(ranks):
        sends = {
            position: message
            for position, message in outputs[rank]
            if message is not None and _rank_of(message.consumer, placement) != rank
        }
        receives: dict[int, Message] = {}
        heard_from: dict[int, list[int]] = {}
        for position, op in enumerate(ops):
            received = input_message(op, stages)
            if received is not None and (peer := made_by[received]) != rank:
                receives[position] = received
                heard_from.setdefault(peer, []).append(position)
        order = list(receives)
        posted = {receives[position]: before for before, position in zip([-1, *order], order)}
        traffic.append(_Rank(sends, heard_from, receives, posted))
    return traffic


def _rank_of(op: Op, placement: Mapping[tuple[int, int], int]) -> int:
    return placement[(op.pipe, op.stage)]


def send_waits(
    ranks: Sequence[Sequence[Op]], placement: Mapping[tuple[int, int], int], num_stages: int, bounded: bool = True
) -> list[dict[int, SendWait | None]]:
    """Per pipeline rank (`ranks[r]`: its op list of one step; `placement`: (pipe, stage) -> pipeline
    rank), the position of each op whose output it sends to another rank -> where it waits for
    that send (module docstring: the earlier of rules (a) and (b); `bounded` False: rule (a)
    alone); None: at the step's end."""
    traffic = _traffic(ranks, placement, num_stages)
    sent_at = [{message: position for position, message in t.sends.items()} for t in traffic]
    result = []
    for mine in traffic:
        following = _next_on_channel(mine.sends) if bounded else {}
        waits: dict[int, SendWait | None] = {}
        for position, message in mine.sends.items():
            peer = _rank_of(message.consumer, placement)
            heard = _heard_back(mine, peer, position, traffic[peer].posted_before[message], sent_at[peer])
            bound = following.get(position)
            waits[position] = bound if heard is None or (bound is not None and bound < heard) else heard
        result.append(waits)
    return result


#: id(schedule) -> (a weak reference to it, its `send_waits`): planners ask again for the same
#: schedule object (`pipefisher.planning.planner.candidates.schedule_of` caches them)
_SCHEDULE_WAITS: dict[int, tuple[weakref.ref, list[dict[int, SendWait | None]]]] = {}


def schedule_send_waits(schedule: Schedule) -> list[dict[int, SendWait | None]]:
    """`send_waits` of `schedule`'s op lists, computed once per schedule object while it lives
    (a schedule is not changed once built; the result is shared: do not change it)."""
    key = id(schedule)
    cached = _SCHEDULE_WAITS.get(key)
    if cached is not None and cached[0]() is schedule:
        return cached[1]
    waits = send_waits(schedule.ranks, schedule.placement, schedule.num_stages)
    _SCHEDULE_WAITS[key] = (weakref.ref(schedule, lambda _: _SCHEDULE_WAITS.pop(key, None)), waits)
    return waits


def _heard_back(
    mine: _Rank, peer: int, position: int, posted: int, peer_sent_at: dict[Message, int]
) -> SendWait | None:
    """Rule (a): the first of `mine`'s inputs after `position` from `peer` that the peer sends
    after the op at `peer_sent_at[input]`, not before the op at `posted` before which it posts the
    receive of the message `mine` sends at `position`."""
    heard = mine.heard_from.get(peer, [])
    for index in range(bisect_right(heard, position), len(heard)):
        if posted <= peer_sent_at[mine.receives[heard[index]]]:
            return SendWait(heard[index])
    return None


def _next_on_channel(sends: dict[int, Message]) -> dict[int, SendWait]:
    """Rule (b): position of a send -> right after the op that makes the next send on its channel."""
    last: dict[tuple, int] = {}
    following: dict[int, SendWait] = {}
    for position, message in sends.items():  # ascending: built in op order
        consumer = message.consumer  # with its kind, pipe and stage, it names the message's channel
        channel = (consumer.kind, consumer.pipe, consumer.stage)
        if channel in last:
            following[last[channel]] = SendWait(position, after_run=True)
        last[channel] = position
    return following
