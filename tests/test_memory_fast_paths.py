"""The planner's fast paths give what they stand for: `message_keys` the keys of
`input_message`/`output_message` on every op of every registered schedule (split backward and
curvature ops included), ZeRO-1's cached owned optimizer bytes the sums over `shard_owners`, and
the heaviest states cached per placement the ranks a scan finds."""

import pytest

from pipefisher.config import load_config
from pipefisher.core.ir import Op, OpKind
from pipefisher.planning.comm.actions import input_message, output_message
from pipefisher.planning.comm.send_waits import message_keys
from pipefisher.planning.memory.state import StageState, optimizer_state
from pipefisher.planning.memory.zero_owned import owned_optimizer_bytes
from pipefisher.planning.planner import layout_memory as layout_memory_module
from pipefisher.planning.planner.candidates import Layout
from pipefisher.planning.planner.layout_memory import MemoryUse, activation_per_rank, layout_memory, state_per_rank
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.planning.replicas.zero import shard_owners
from pipefisher.schedules import SCHEDULES, get_schedule


def _key(message) -> tuple | None:
    if message is None:
        return None
    consumer = message.consumer
    return (consumer.kind, consumer.stage, consumer.micro_batch, consumer.pipe)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_message_keys_are_the_messages_keys(name):
    schedule = get_schedule(name, 4, 8)
    curvature = Op(OpKind.CURVATURE, 1, 0, layer="fc1", part=0)
    for ops in schedule.ranks:
        ops = (*ops, curvature)
        expected = [
            (_key(input_message(op, schedule.num_stages)), _key(output_message(op, schedule.num_stages))) for op in ops
        ]
        assert message_keys(ops, schedule.num_stages) == expected
    assert any(received and made for ops in schedule.ranks for received, made in message_keys(ops, schedule.num_stages))


@pytest.mark.parametrize("ranks", [(0,), (1, 5), (2, 3, 7), (0, 4, 8, 12, 16)])
def test_owned_optimizer_bytes_sum_over_the_owners(ranks):
    stage = StageState(
        (7, 300, 5, 300, 2, 64, 64, 9), preconditioned=(True, False, True, True, False, True, True, True)
    )
    optimizer = optimizer_state("kfac", 0.9, first_order="adamw", memory="pipefisher.methods.kfac.memory:KfacLayer")
    expected = dict.fromkeys(ranks, 0)
    for number, owner in enumerate(shard_owners(stage.parameters, ranks)):
        expected[owner] += optimizer.tensor_bytes(stage.parameters[number], stage.preconditions(number))
    assert owned_optimizer_bytes(stage, optimizer, ranks) == expected
    assert owned_optimizer_bytes(stage, optimizer, ranks) == expected  # from the cache
    assert sum(expected.values()) > 0


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_layouts_sharing_a_placement_share_their_heaviest_states(zero):
    """`layout_memory` caches the heaviest states on the placement, not the schedule's name or
    micro-batches: each layout still gets the rank and bytes a scan over its own ranks finds."""
    sizes = model_sizes(load_config("schedules/bert-base-1f1b-4x4.yaml"))
    layouts = [
        Layout(4, 2, 1, name, 1, micro_batches, 8, zero=zero, method="adamw")
        for name in ("gpipe", "1f1b", "zb-h1")
        for micro_batches in (4, 8)
    ]
    cached = len(layout_memory_module._HEAVIEST)
    for layout in layouts:
        states = state_per_rank(layout, sizes, "adamw", 0.9)
        activations = activation_per_rank(layout, sizes)
        scanned = max(
            (MemoryUse(rank, state.total_bytes, activations[rank % 4]) for rank, state in enumerate(states)),
            key=lambda use: use.total,
        )
        assert layout_memory(layout, sizes, "adamw", 0.9) == scanned
    assert len(layout_memory_module._HEAVIEST) - cached <= 1  # one placement: computed once
