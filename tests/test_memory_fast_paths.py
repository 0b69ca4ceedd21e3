"""The planner's fast paths give what they stand for: `message_keys` the keys of
`input_message`/`output_message` on every op of every registered schedule (split backward and
curvature ops included), and ZeRO-1's cached owned optimizer bytes the sums over `shard_owners`."""

import pytest

from pipefisher.core.ir import Op, OpKind
from pipefisher.planning.comm.actions import input_message, output_message
from pipefisher.planning.comm.send_waits import message_keys
from pipefisher.planning.memory.state import StageState, optimizer_state
from pipefisher.planning.memory.zero_owned import owned_optimizer_bytes
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
