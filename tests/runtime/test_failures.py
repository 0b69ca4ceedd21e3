"""A failing or killed rank brings the whole group down, fast, with messages naming rank, step, op."""

import multiprocessing
import time

import pytest

from _workers import failing, hanging, killed, raising
from pipefisher.runtime.training.launch import GroupFailure, run_group

pytestmark = pytest.mark.dist
TIMEOUT = 10


def run_expecting_failure(worker, config):
    start = time.monotonic()
    with pytest.raises(GroupFailure) as info:
        run_group(worker, 2, args=(config,), timeout=TIMEOUT, deadline=90)
    elapsed = time.monotonic() - start
    assert multiprocessing.active_children() == []
    return info.value, elapsed


def test_a_rank_that_raises_stops_every_rank(tiny_config):
    failure, elapsed = run_expecting_failure(raising, tiny_config(schedule="1f1b"))
    assert set(failure.failures) == {0, 1}
    assert "rank 1 failed at step 2, op 1B2: ValueError: injected fault" in failure.failures[1]
    assert "rank 0 failed at step 2" in failure.failures[0]
    assert elapsed < 2 * TIMEOUT + 10


def test_a_killed_rank_stops_every_rank(tiny_config):
    failure, elapsed = run_expecting_failure(killed, tiny_config(schedule="gpipe"))
    assert "exited with code -9" in failure.failures[1]
    assert "rank 0 failed at step 2, op" in failure.failures[0]
    assert elapsed < 2 * TIMEOUT + 10


def test_launcher_reports_child_tracebacks_and_kills_the_rest():
    start = time.monotonic()
    with pytest.raises(GroupFailure, match="(?s)rank 1: ValueError: rank one is broken.*Traceback"):
        run_group(failing, 2, timeout=60, grace=2)
    assert time.monotonic() - start < 30
    assert multiprocessing.active_children() == []


def test_launcher_enforces_the_deadline():
    start = time.monotonic()
    with pytest.raises(GroupFailure, match="rank 1: no result before the deadline"):
        run_group(hanging, 2, timeout=60, deadline=6)
    assert time.monotonic() - start < 15
    assert multiprocessing.active_children() == []
