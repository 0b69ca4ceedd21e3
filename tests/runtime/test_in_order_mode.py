"""The in-order test mode holds gloo to NCCL's rule: the issue order the replay rejects hangs there
(and times out with the group named), while plain gloo lets it through."""

import pytest

from _workers import shared_channel_1f1b
from pipefisher.runtime.training.launch import GroupFailure, run_group

pytestmark = pytest.mark.dist


def test_plain_gloo_lets_the_old_issue_order_through():
    assert run_group(shared_channel_1f1b, 2, args=(False,), timeout=10, deadline=60) == ["g0=3", "a0=1 a1=2"]


def test_the_in_order_mode_hangs_on_it_like_nccl():
    with pytest.raises(GroupFailure) as info:
        run_group(shared_channel_1f1b, 2, args=(True,), timeout=10, grace=10, deadline=60)
    assert any(
        "nothing completed on group ('p2p',) within 5 s (in-order mode)" in message
        for message in info.value.failures.values()
    )
