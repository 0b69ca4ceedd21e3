"""The labels of a step in a profiler trace, shared by the executor that writes them and
`pipefisher.viz.trace_io` that reads them: ``step N`` around step N (1-based), and after it
``step N time T ms``, T being the step's time as `pipefisher run` reports it (the executor's own
timer, written with every digit of the float so that it reads back exactly)."""

from __future__ import annotations

import re

#: the region in which the executor builds the next step's micro-batches (after a step's actions)
PREPARE = "prepare micro-batches"

STEP = re.compile(r"step (\d+)$")
STEP_TIME = re.compile(r"step (\d+) time (\S+) ms$")


def step_label(step: int) -> str:
    """The region around step `step` (1-based)."""
    return f"step {step}"


def step_time_label(step: int, ms: float) -> str:
    """The marker after step `step` (1-based) carrying its time `ms`; `STEP_TIME` reads it back."""
    return f"step {step} time {ms!r} ms"
