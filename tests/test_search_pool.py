"""The planner's process pool (`SearchPool`, `plan --jobs`): results in the items' order whatever
the grouping, a worker that dies ends the search with an error instead of a hang, and leaving the
pool early stops work still running."""

from __future__ import annotations

import os
import time
from concurrent.futures.process import BrokenProcessPool

import pytest

from pipefisher.planning.planner.search_pool import SearchPool, inputs


def _scaled(item: int) -> tuple[int, int, int]:
    return item, item * inputs(), os.getpid()


def _dies(item: int) -> int:
    if item == 3:
        os._exit(9)  # as the kernel's out-of-memory killer leaves it: no exception, no result
    return item


def _sleeps(item: int) -> int:
    time.sleep(item)
    return item


@pytest.mark.parametrize("jobs", [1, 2])
def test_results_come_in_the_items_order_whatever_their_groups(jobs: int) -> None:
    items = list(range(40))
    with SearchPool(jobs, 3) as pool:
        found = list(pool.map(_scaled, items, group=lambda item: -(item % 5)))
        late = pool.later(_scaled, 7)
        ahead = list(pool.lookahead(_scaled, items[:5]))
    assert [(item, scaled) for item, scaled, _ in found] == [(item, 3 * item) for item in items]
    assert late()[:2] == (7, 21) and [entry[:2] for entry in ahead] == [(i, 3 * i) for i in range(5)]
    workers = {pid for *_, pid in found}
    assert (workers == {os.getpid()}) == (jobs == 1)


def test_a_dead_worker_ends_the_search_with_an_error() -> None:
    started = time.monotonic()
    with pytest.raises(BrokenProcessPool), SearchPool(2, None) as pool:
        list(pool.map(_dies, list(range(8)), group=lambda item: item))
    assert time.monotonic() - started < 30


def test_leaving_the_pool_stops_work_still_running() -> None:
    started = time.monotonic()
    with SearchPool(2, None) as pool:
        first = next(iter(pool.lookahead(_sleeps, [0, 60, 60])))
    assert first == 0 and time.monotonic() - started < 30
