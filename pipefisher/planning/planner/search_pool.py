"""A layout search's work spread over processes (`plan --jobs`): each phase maps a function over
layouts and yields the results in the layouts' order, so a search ranks exactly as with one job.
Workers are forked where the platform allows (they start with the parent's caches) and get the
search's inputs once, at their start; a worker that dies (e.g. out of memory) ends the search
with `BrokenProcessPool` instead of leaving it waiting. Pure Python: no torch."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

#: chunks of mapped items per worker (more balance the load, fewer keep a group on one worker)
_CHUNKS_PER_JOB = 8
#: the search's inputs in a worker (`_start_worker`): what every mapped function reads
_INPUTS: Any = None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def inputs() -> Any:
    """The search's inputs: the pool's in a worker, the last `SearchPool`'s in the parent."""
    return _INPUTS


def _start_worker(given: Any) -> None:
    """Keep the search's inputs; leave Ctrl-C to the parent, which stops the pool, and end quietly
    at its stop (a forked worker inherits the parent's handlers, e.g. the CLI's)."""
    global _INPUTS
    _INPUTS = given
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class SearchPool:
    """`jobs` processes (1: none, all in this process) that map functions of one argument over
    layouts, each reading the search's `inputs()`; use as a context manager (at its end the
    workers stop, unfinished work is dropped)."""

    def __init__(self, jobs: int, given: Any):
        if jobs < 1:
            raise ValueError(f"jobs: {jobs} must be >= 1")
        global _INPUTS
        _INPUTS = given
        self.jobs = jobs
        self._executor: ProcessPoolExecutor | None = None
        if jobs > 1:
            context = multiprocessing.get_context("fork" if sys.platform == "linux" else None)
            self._executor = ProcessPoolExecutor(jobs, context, _start_worker, (given,))

    def __enter__(self) -> SearchPool:
        return self

    def __exit__(self, *exc: object) -> None:
        executor = self._executor
        if executor is None:
            return
        running = list((executor._processes or {}).values())  # (no public way to stop a running task before 3.14)
        for process in running:  # first: a worker's end wakes the executor's thread, which shutdown may wait for
            process.terminate()
        executor.shutdown(wait=False, cancel_futures=True)
        for process in running:
            process.join()

    def map(self, function: Callable[[Any], Any], items: Sequence, group: Callable[[Any], Any]) -> Iterator:
        """`function(item)` for each item, in order; the workers take the items sorted by `group`
        in contiguous chunks, so that items of one group mostly share a worker (and its caches)."""
        if self._executor is None:
            yield from map(function, items)
            return
        order = sorted(range(len(items)), key=lambda index: group(items[index]))
        chunk = max(1, len(items) // (self.jobs * _CHUNKS_PER_JOB))
        results: dict[int, Any] = {}
        following = 0
        for index, result in zip(order, self._executor.map(function, [items[i] for i in order], chunksize=chunk)):
            results[index] = result
            while following in results:
                yield results.pop(following)
                following += 1

    def later(self, function: Callable[[Any], Any], item: Any) -> Callable[[], Any]:
        """`function(item)`, started now on a worker (before the work mapped after it); call the
        returned function for the result (with one job: computed then)."""
        if self._executor is None:
            return lambda: function(item)
        return self._executor.submit(function, item).result

    def lookahead(self, function: Callable[[Any], Any], items: Sequence) -> Iterator:
        """`function(item)` for each item, in order, one item per task: for expensive items a caller
        may stop reading early (the workers' unread results are dropped at the pool's end)."""
        if self._executor is None:
            return map(function, items)
        return self._executor.map(function, items)
