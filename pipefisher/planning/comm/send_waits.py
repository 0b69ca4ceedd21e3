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
from pipefisher.planning.comm.actions import message_ends


@dataclass(frozen=True, slots=True, order=True)
class SendWait:
    """Where the rank waits for a send: around its op at `position` (in the rank's op list of the
    step), before the op runs (right after its input is in; `after_run` False) or right after it
    runs (before the op's own send; True). Ordered: the earlier slot is the smaller."""

    position: int
    after_run: bool = False


#: a message by its consumer's (kind, stage, micro-batch, pipe): a plain tuple hashes and compares
#: faster than the `Message` it stands for, and a step has tens of thousands
_Key = tuple


def message_keys(ops: Sequence[Op], stages: int) -> list[tuple[_Key | None, _Key | None]]:
    """Per op, the keys of the messages it receives and sends (`message_ends`; None: none): those
    of `input_message` and `output_message`, without building their ops."""
    found: list[tuple[_Key | None, _Key | None]] = []
    for op in ops:
        receives, to = message_ends(op, stages)
        found.append(
            (
                (op.kind, op.stage, op.micro_batch, op.pipe) if receives else None,
                None if to is None else (op.kind, to, op.micro_batch, op.pipe),
            )
        )
    return found


@dataclass(frozen=True)
class _Rank:
    """One pipeline rank's point-to-point traffic of a step, by position in its op list."""

    #: position -> the message the op there sends to another rank, and that rank
    sends: dict[int, tuple[_Key, int]]
    #: peer rank -> positions of the ops that receive their input from it, ascending
    heard_from: dict[int, list[int]]
    #: peer rank -> the message each op of `heard_from[peer]` receives, in the same order
    heard: dict[int, list[_Key]]
    #: message received -> position of the op before which its receive is posted (-1: first thing)
    posted_before: dict[_Key, int]


def _traffic(ranks: Sequence[Sequence[Op]], placement: Mapping[tuple[int, int], int], stages: int) -> list[_Rank]:
    """Every pipeline rank's sends and receives (a message is received from the rank that makes it)."""
    keys = [message_keys(ops, stages) for ops in ranks]
    made_by = {made: rank for rank, mine in enumerate(keys) for _, made in mine if made is not None}
    traffic = []
    for rank, mine in enumerate(keys):
        sends: dict[int, tuple[_Key, int]] = {}
        heard_from: dict[int, list[int]] = {}
        heard: dict[int, list[_Key]] = {}
        posted: dict[_Key, int] = {}
        before = -1
        for position, (received, made) in enumerate(mine):
            if received is not None and (peer := made_by[received]) != rank:
                if peer not in heard:
                    heard_from[peer], heard[peer] = [], []
                heard_from[peer].append(position)
                heard[peer].append(received)
                posted[received] = before
                before = position
            if made is not None and (consumer := placement[(made[3], made[1])]) != rank:
                sends[position] = (made, consumer)
        traffic.append(_Rank(sends, heard_from, heard, posted))
    return traffic


def send_waits(
    ranks: Sequence[Sequence[Op]], placement: Mapping[tuple[int, int], int], num_stages: int, bounded: bool = True
) -> list[dict[int, SendWait | None]]:
    """Per pipeline rank (`ranks[r]`: its op list of one step; `placement`: (pipe, stage) -> pipeline
    rank), the position of each op whose output it sends to another rank -> where it waits for
    that send (module docstring: the earlier of rules (a) and (b); `bounded` False: rule (a)
    alone); None: at the step's end."""
    traffic = _traffic(ranks, placement, num_stages)
    sent_at = [{key: position for position, (key, _) in t.sends.items()} for t in traffic]
    result = []
    for mine in traffic:
        following = _next_on_channel(mine.sends) if bounded else {}
        #: peer -> where the peer sends each input `mine` hears from it, in `heard_from` order
        answered = {peer: [sent_at[peer][key] for key in keys] for peer, keys in mine.heard.items()}
        waits: dict[int, SendWait | None] = {}
        for position, (key, peer) in mine.sends.items():
            heard = _heard_back(
                mine.heard_from.get(peer, []), answered.get(peer, []), position, traffic[peer].posted_before[key]
            )
            bound = following.get(position)
            # the earlier slot: after the op at `bound` comes before the input at `heard` only if earlier
            if bound is not None and (heard is None or bound < heard):
                waits[position] = SendWait(bound, after_run=True)
            else:
                waits[position] = None if heard is None else SendWait(heard)
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


def _heard_back(heard_from: list[int], answered: list[int], position: int, posted: int) -> int | None:
    """Rule (a): the position of the first input after `position` (`heard_from`: positions of the
    inputs from the peer, ascending) that the peer sends after the op at `answered[index]`, not
    before the op at `posted` before which it posts the receive of the message sent at `position`."""
    for index in range(bisect_right(heard_from, position), len(heard_from)):
        if posted <= answered[index]:
            return heard_from[index]
    return None


def _next_on_channel(sends: dict[int, tuple[_Key, int]]) -> dict[int, int]:
    """Rule (b): position of a send -> the op that makes the next send on its channel (the wait
    comes right after it runs)."""
    last: dict[tuple, int] = {}
    following: dict[int, int] = {}
    for position, (key, _) in sends.items():  # ascending: built in op order
        channel = (key[0], key[3], key[1])  # the consumer's kind, pipe and stage name the message's channel
        if channel in last:
            following[last[channel]] = position
        last[channel] = position
    return following
