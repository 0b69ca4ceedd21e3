"""The arms of experiments/bench_exposed.py: one `pipefisher run FILE --json` each (it launches
its 2 ranks itself), first-order or one curvature method, on the layout every arm of a schedule
shares (`Layout`); their per-step times (rank 0's step timer, `step_time_ms`) and the window of
whole refresh cycles they are compared over (`cycle_window`).

A method runs packed (`placement: packed`) with the profile `pipefisher run` measures before
training, at refresh interval `Layout.refresh_steps` (0: the packer's choice, capped at
`max_refresh_steps`); re-profiling is off (`reprofile_threshold` 1e9), since a re-profile would
land inside a timed step. A traced run writes a PyTorch profiler trace of `TraceSpan` steps per
rank; `traced_ranks` reads each rank's busy and waiting time from it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from experiments.common import RunFailed, machine_busy_seconds
from experiments.exposed.stats import RankTime
from experiments.overhead.workloads import ROOT, Workload
from pipefisher.viz.trace_io import trace_files
from pipefisher.viz.trace_summary import summarise

STAGES = 2
#: re-profiling threshold of every method run: never (a re-profile would be timed as a step)
NO_REPROFILING = 1e9


@dataclass(frozen=True)
class TraceSpan:
    """Trace `steps` steps from step `first` (1-based) into `folder`."""

    folder: Path
    first: int
    steps: int


@dataclass(frozen=True)
class Layout:
    """What every arm of one schedule shares: the model (`workload`), `schedule` on 2 stages,
    `micro_batches` of `micro_batch_size` sequences, the `first_order` optimizer, the refresh
    interval (`refresh_steps`, 0 = the packer's choice up to `max_refresh_steps`), at least
    `warmup` untimed steps and `cycles` timed refresh cycles per run."""

    workload: Workload
    schedule: str
    micro_batches: int
    micro_batch_size: int
    first_order: str
    refresh_steps: int
    max_refresh_steps: int
    warmup: int
    cycles: int

    @property
    def steps(self) -> int:
        """Steps of an untraced run: room for the warm-up and `cycles` whole cycles at any k the run may get."""
        k = self.refresh_steps
        if k:
            return -(-self.warmup // k) * k + self.cycles * k
        return self.warmup + (self.cycles + 1) * self.max_refresh_steps

    def flags(self, method: str | None, steps: int, trace: TraceSpan | None) -> list[str]:
        """`pipefisher run`'s flags for the first-order arm (`method` None) or a method's arm."""
        sections: dict[str, dict[str, object]] = {
            "model": dict(self.workload.model),
            "pipeline": {
                "schedule": self.schedule,
                "stages": STAGES,
                "micro_batches": self.micro_batches,
                "data_parallel": 1,
            },
            "data": {"micro_batch_size": self.micro_batch_size},
            "optimizer": {"name": method or self.first_order},
            "run": {"steps": steps, "backend": "gloo"},
        }
        if method is not None:
            sections[method] = {
                "placement": "packed",
                "refresh_steps": self.refresh_steps,
                "reprofile_threshold": NO_REPROFILING,
            }
            if not self.refresh_steps:
                sections[method]["max_refresh_steps"] = self.max_refresh_steps
        if trace is not None:
            sections["run"].update(trace=str(trace.folder), trace_from=trace.first, trace_steps=trace.steps)
        return [
            flag
            for section, values in sections.items()
            for key, value in values.items()
            for flag in (f"--{section}.{key}", str(value))
        ]


@dataclass(frozen=True)
class ArmRun:
    """One run: every step's time [ms] (rank 0's timer), its refresh interval k (None: first
    order), the tokens per step it reported (as its tokens/s x step time), its wall time [s]
    start-up included, and the cores other processes of the machine used meanwhile
    (machine-wide busy time less this run's processes', / wall time)."""

    step_ms: tuple[float, ...]
    refresh_steps: int | None
    tokens_per_step: int
    seconds: float
    other_cores: float


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_arm(layout: Layout, method: str | None, steps: int, trace: TraceSpan | None, timeout: float) -> ArmRun:
    """Run one arm for `steps` steps (RunFailed, one line, if it fails or reports other steps)."""
    command = [sys.executable, "-m", "pipefisher", "run", layout.workload.run_file, "--json", "--master-port", "0"]
    command += layout.flags(method, steps, trace)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    machine, ours, start = machine_busy_seconds(), _children_cpu(), time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    other = max(0.0, machine_busy_seconds() - machine - (_children_cpu() - ours)) / seconds
    arm = method or layout.first_order
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RunFailed(f"{layout.schedule} {arm}: pipefisher run exited with {done.returncode}: {last}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(records) != steps:
        raise RunFailed(f"{layout.schedule} {arm}: pipefisher run reported {len(records)} steps, not {steps}")
    k = records[-1].get("refresh_steps") if method is not None else None
    tokens = round(records[0]["tokens_per_s"] * records[0]["step_time_ms"] / 1000)
    return ArmRun(tuple(r["step_time_ms"] for r in records), k, tokens, seconds, other)


def cycle_window(k: int, warmup: int, steps: int) -> range:
    """The 0-based steps of the whole refresh cycles of interval `k` (cycles start at step 0)
    after at least `warmup` steps, up to `steps`; RunFailed when not one cycle fits."""
    start = -(-warmup // k) * k
    stop = start + (steps - start) // k * k
    if stop <= start:
        raise RunFailed(f"refresh interval k={k}: no whole cycle fits after {warmup} warm-up steps in {steps} steps")
    return range(start, stop)


def mean_ms(run: ArmRun, window: range) -> float:
    """The run's mean step time [ms] over `window`."""
    return sum(run.step_ms[i] for i in window) / len(window)


def traced_ranks(folder: Path) -> tuple[RankTime, ...]:
    """Per rank, its mean traced step [ms] and the part of it in the executor's waits
    (`pipefisher.viz.trace_summary`: the actions labelled ``w:``/``wsend:``; the end of step's
    wait on the world reduction counts as busy)."""
    wall: dict[int, list[float]] = defaultdict(list)
    idle: dict[int, list[float]] = defaultdict(list)
    for summary in summarise(trace_files(folder)):
        wall[summary.rank].append(summary.wall)
        idle[summary.rank].append(summary.actions.get("wait", 0.0))
    return tuple(
        RankTime(rank, sum(wall[rank]) / len(wall[rank]), sum(idle[rank]) / len(idle[rank])) for rank in sorted(wall)
    )
