"""What `pipefisher run` shows while it trains: a progress bar or one line per step, a metrics file, and a
summary when the run completed (a failed or stopped run has none).

Rank 0 reports. stdout carries only the step lines (JSON with --json); the progress bar, logs
and the summary go to stderr. The step record goes to stdout with --json and to every sink the run
asks for (`pipefisher.cli.metric_sinks`: the metrics file, TensorBoard, W&B): step, loss, its
parts (MLM/NSP), lr (with a curvature method: its rate; `lr_rest`: the rate of the parameters it
does not precondition), step_time_ms, tokens_per_s, rank0_peak_memory_mib (`peak_memory_mib`), on evaluation steps (`run.eval_every`) the
held-out `eval_loss`, `train_s` (training seconds so far), `out_of_time` on the step that ended the
run's time budget (`run.time_budget_s`), and, with a curvature method, the refresh interval,
the predicted step time and, from the end of the refresh cycle it was measured on, the exposed
optimizer time: `exposed_share` (the simulated mean step with the method's work over the
first-order step of the same layout, both on the op times the run measured on its own steps,
minus 1), `exposed_first_order_step_time_ms`, `exposed_step_time_ms`,
`exposed_measured_step_time_ms` (the mean wall time of those steps) and `exposed_steps` (first,
last; `pipefisher.runtime.training.exposed_meter`).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import threading

import torch

from pipefisher.cli.metric_sinks import open_sinks
from pipefisher.config import RunConfig
from pipefisher.core.terminal import progress_bars
from pipefisher.methods.registry import method
from pipefisher.runtime.pipeline.executor import StepResult
from pipefisher.runtime.training.assembly import tokens_per_step


class StepReporter:
    """Call with every StepResult; `close()` prints the summary. A progress bar replaces the
    text lines when stderr is a terminal and stdout is not used for JSON."""

    def __init__(self, config: RunConfig, as_json: bool, first_step: int = 0, progress: bool | None = None):
        self.config, self.as_json = config, as_json
        self.total = config.run.steps
        self.tokens = tokens_per_step(config)
        self.sinks = open_sinks(config)
        self.rest_rate = _rest_rate(config)
        self.times: list[float] = []
        self.last: dict = {}
        use_bar = progress_bars() and not as_json if progress is None else progress
        self.bar = None
        if use_bar:
            from tqdm import tqdm

            # tqdm's default lock is a multiprocessing one: a semaphore that a rank leaving with
            # os._exit never frees (the resource tracker then warns at shutdown); one process
            # draws the bar, so a thread lock is enough
            tqdm.set_lock(threading.RLock())
            self.bar = tqdm(total=self.total, initial=first_step, unit="step", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, result: StepResult) -> None:
        record = {
            "step": result.step,
            "loss": result.loss,
            **{k: v for k, v in result.extra.items()},
            "step_time_ms": 1000 * result.seconds,
            "tokens_per_s": self.tokens / result.seconds if result.seconds > 0 else 0.0,
            "rank0_peak_memory_mib": peak_memory_mib(),
        }
        if self.rest_rate is not None and "lr" in record:
            record["lr_rest"] = record["lr"] * self.rest_rate
        self.times.append(result.seconds)
        self.last = record
        for sink in self.sinks:
            sink.write(record, result.step)
        if self.as_json:
            print(json.dumps(record), flush=True)
        elif self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        else:
            line = f"step {result.step}/{self.total}  loss {result.loss:.6f}  step time {record['step_time_ms']:.1f} ms"
            if "mlm" in record:
                line += f"  (mlm {record['mlm']:.4f}, nsp {record['nsp']:.4f})"
            if "eval_loss" in record:
                line += f"  eval loss {record['eval_loss']:.6f}"
            if "predicted_step_time_ms" in record:
                line += f"  predicted {record['predicted_step_time_ms']:.1f} ms, k={record['refresh_steps']}"
            print(line, flush=True)

    def close(self, completed: bool = True, state_bytes: tuple[dict[str, int], ...] = ()) -> None:
        """Close the bar and the sinks; the summary only for a run that `completed`, with
        every rank's optimizer-state and curvature-state MiB when given (`TrainResult.state_bytes`)."""
        if self.bar is not None:
            self.bar.close()
        for sink in self.sinks:
            sink.close()
        if not self.times or not completed:
            return
        median = statistics.median(self.times)
        summary = (
            f"pipefisher: {len(self.times)} steps, final loss {self.last['loss']:.6f}, median step {1000 * median:.1f} ms, "
            f"{self.tokens / median:.0f} tokens/s"
        )
        if "refresh_steps" in self.last:
            label = method(self.config.optimizer.name).label
            summary += f", {label} every {self.last['refresh_steps']} steps (predicted {self.last['predicted_step_time_ms']:.1f} ms/step)"
        if "exposed_share" in self.last:
            first, last = self.last["exposed_steps"]
            summary += (
                f"; exposed optimizer time {100 * self.last['exposed_share']:+.1f} % over first-order "
                f"({self.last['exposed_first_order_step_time_ms']:.1f} ms simulated on the op times of steps {first}-{last}, "
                f"which took {self.last['exposed_measured_step_time_ms']:.1f} ms each)"
            )
        if self.last.get("out_of_time"):
            summary += (
                f"; ended at step {self.last['step']} of {self.total}: the time budget of "
                f"{self.config.run.time_budget_s:g} s ran out after {self.last['train_s']:.1f} s of training"
            )
        print(summary, file=sys.stderr, flush=True)
        if state_bytes:
            each = "process" if self.config.pipeline.tensor_parallel > 1 else "rank"
            print(
                f"pipefisher: state per {each}, MiB: optimizer {_mib(state_bytes, 'optimizer')}"
                + (
                    f"; {method(self.config.optimizer.name).label} {_mib(state_bytes, 'curvature')}"
                    if self.config.curvature
                    else ""
                )
                + (f"; PowerSGD {_mib(state_bytes, 'compression')}" if self.config.comm.powersgd_rank else ""),
                file=sys.stderr,
                flush=True,
            )


def peak_memory_mib() -> float:
    """This process's peak memory so far, MiB: the CUDA allocator's peak allocated bytes on its
    current device when the process uses CUDA, else its peak resident set size. Host counters:
    reading them does not synchronise with the device."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rest_rate(config: RunConfig) -> float | None:
    """A curvature run's rate of the rest over its method's (the schedule scales both alike, so
    lr_rest = lr x this); None for a first-order run, which has one rate."""
    if config.curvature is None:
        return None
    return config.rest_settings.lr / config.optimizer_settings.lr


def _mib(state_bytes: tuple[dict[str, int], ...], part: str) -> str:
    """Rank by rank, e.g. ``0.52 0.52 0.49 0.49``."""
    return " ".join(f"{ranks[part] / 2**20:.3g}" for ranks in state_bytes)
