"""Where `pipefisher run`'s step records go besides the terminal: the JSON-lines file of
`run.metrics`, TensorBoard event files (`run.tensorboard`) and a Weights & Biases run (`run.wandb`,
`run.wandb_mode`). Every sink gets the same record, the one `StepReporter` builds (units in its key
names: step_time_ms, tokens_per_s), and the run's 1-based step; only the reporting process (rank 0)
opens sinks, so a run writes one event file and one W&B run however many processes it has.

TensorBoard and W&B are optional packages (`pip install pipefisher[log]`): `missing_package` names
a sink key set without its package, for the command to refuse before any process starts."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from pipefisher.config import RunConfig, config_to_dict

#: the extra that installs every optional sink's package
LOG_EXTRA = "pip install pipefisher[log]"
#: run key -> the module its sink imports
SINK_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class MetricSink(Protocol):
    """Takes every step's record, in step order; `close` once at the end (a failed run's too)."""

    def write(self, record: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's finite numbers by key (true/false as 1/0), without `step` (the axis); lists
    (exposed_steps) and strings are left out."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and math.isfinite(value)
    }


class JsonLines:
    """Appends each record as one JSON object per line to `path`, flushed at once (a killed run
    keeps every finished step)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a")

    def write(self, record: Mapping[str, Any], step: int) -> None:
        self.file.write(json.dumps(dict(record)) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoard:
    """One scalar per number of the record (tag = its key) at global step `step`, in an event
    file under `folder` (torch's `SummaryWriter`; TensorBoard reads the folder)."""

    def __init__(self, folder: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=folder, flush_secs=10)

    def write(self, record: Mapping[str, Any], step: int) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """One W&B run in `project`, `mode` online, offline (a local folder under WANDB_DIR or the
    working folder; `wandb sync` uploads it) or disabled; its config is the run file as pipefisher
    took it, its history the records' numbers at step `step`. wandb's console capture is off, so
    stdout keeps only the step lines."""

    def __init__(self, project: str, mode: Literal["online", "offline", "disabled"], config: dict[str, Any]) -> None:
        import wandb

        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        self.run = wandb.init(project=project, mode=mode, config=config, settings=settings)
        if mode != "disabled":
            folder = os.path.dirname(self.run.dir)  # run.dir is the run folder's files/
            upload = f"; `wandb sync {folder}` uploads it" if mode == "offline" else ""
            print(f"pipefisher: W&B run {self.run.id} ({mode}) in {folder}{upload}", file=sys.stderr, flush=True)

    def write(self, record: Mapping[str, Any], step: int) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


def missing_package(config: RunConfig) -> str | None:
    """One line for the first sink key set whose package is not installed, None when all are."""
    for key, module in SINK_PACKAGES.items():
        if getattr(config.run, key) and importlib.util.find_spec(module) is None:
            return f"run.{key}: the {module} package is not installed; {LOG_EXTRA}"
    return None


def open_sinks(config: RunConfig) -> list[MetricSink]:
    """The sinks the run's keys ask for, in order metrics, tensorboard, wandb (none: [])."""
    run = config.run
    sinks: list[MetricSink] = []
    if run.metrics:
        sinks.append(JsonLines(run.metrics))
    if run.tensorboard:
        sinks.append(TensorBoard(run.tensorboard))
    if run.wandb:
        sinks.append(WandB(run.wandb, run.wandb_mode, config_to_dict(config)))
    return sinks
