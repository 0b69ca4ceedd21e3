"""`run.trace`: a PyTorch profiler trace of a few steps per rank, every executor action labelled.

The executor labels its actions (`pipefisher.runtime.pipeline.executor`) whenever a profiler is
on; this module turns one on for steps `trace_from .. trace_from + trace_steps - 1` (1-based),
with one untraced warm-up step before them when there is one, and writes
`<run.trace>/rank<R>.json` (Chrome trace format: ui.perfetto.dev, chrome://tracing,
`pipefisher viz --trace`). Off (`run.trace: ""`), nothing is started. The profiler's own log
lines (kineto's `profiler_start`, `profiler_stop`) are off unless KINETO_LOG_LEVEL asks for them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from pipefisher.config import RunConfig


#: kineto's log level above all of its messages (its highest, USDT, is 5)
QUIET_KINETO = "6"


def trace_file(folder: str | Path, rank: int) -> Path:
    """Where rank `rank`'s trace goes."""
    return Path(folder) / f"rank{rank}.json"


class StepTracer:
    """Call `before(step)` and `after(step)` (0-based) around every step of the run."""

    def __init__(self, config: RunConfig, rank: int, device: torch.device):
        self.path = trace_file(config.run.trace, rank) if config.run.trace else None
        first = config.run.trace_from - 1
        self.warmup = 1 if first > 0 else 0
        self.start, self.end = first - self.warmup, first + config.run.trace_steps
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler: profile | None = None

    def before(self, step: int) -> None:
        if self.path is None or step != self.start:
            return
        os.environ.setdefault("KINETO_LOG_LEVEL", QUIET_KINETO)  # read as the profiler first starts
        self.profiler = profile(
            activities=self.activities,
            schedule=schedule(wait=0, warmup=self.warmup, active=self.end - self.start - self.warmup, repeat=1),
            on_trace_ready=self._write,
        )
        self.profiler.start()

    def after(self, step: int) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        if step + 1 == self.end:
            self.profiler.stop()
            self.profiler = None

    def _write(self, finished: profile) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        finished.export_chrome_trace(str(partial))
        os.replace(partial, self.path)
