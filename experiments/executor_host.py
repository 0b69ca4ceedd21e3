"""The executor's host work per step, before and after issue 43's two changes, side by side on
one rank (the whole model as one stage, in a process group of one):

- weight casts per bf16 step (`aten._to_copy` of a parameter): before, every stage forward's
  autocast recast every weight, once per micro-batch; after, the step's cast scope
  (`Precision.step_casts`) keeps the copies, one per weight and step. "Before" is the same
  executor with the step's scope off (the stages' autocast unchanged).
- the host time of building micro-batches per step: before, inside the step's ops (each at its
  first forward); after, the next step's prepared at the end of the step (`Executor.steps`),
  where a GPU is still working and the step's reduction is in flight. Steps alternate between
  the two, repeats' medians.

    python experiments/executor_host.py                          # BERT 4x128 and GPT-2 tiny, 4 micro-batches
    python experiments/executor_host.py --device cuda --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

import torch  # noqa: E402

from experiments.common import ROOT  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402
from pipefisher.config import load_config  # noqa: E402
from pipefisher.runtime.training import (  # noqa: E402
    Executor,
    PlanRunner,
    Precision,
    build_executor,
    schedule_plan,
    world_of_one,
)
from pipefisher.testing.casts import WeightCasts  # noqa: E402

RUNS = ("schedules/tiny-cpu.yaml", "schedules/gpt2-tiny-cpu.yaml")


class BuildTimer:
    """Wraps the executor's data source: host seconds spent building micro-batches, per phase
    (inside the step's ops, or ahead at the end of the step before)."""

    def __init__(self, executor: Executor):
        self.source, self.executor = executor.micro_batch, executor
        self.seconds: Counter[str] = Counter()
        executor.micro_batch = self

    def __call__(self, step: int, index: int) -> dict:
        start = time.perf_counter()
        batch = self.source(step, index)
        phase = "ahead" if step > self.executor.current_step else "inside"
        self.seconds[phase] += time.perf_counter() - start
        return batch


def variant_of(step: int) -> str:
    """Steps 1 and 2 count casts; timed steps from 3 on alternate in ABBA order (neither always first)."""
    index = step - 1 if step < 3 else step - 3
    return ("before", "after")[index % 2 if step < 3 else (index + index // 2) % 2]


def measure(path: str, device: torch.device, micro_batches: int, steps: int) -> dict:
    """Casts per weight and step, and medians over `steps` steps per variant of the host ms spent
    building micro-batches inside the step's ops and ahead, and of the step's wall time."""
    last = 2 * steps + 3
    config = load_config(ROOT / path).with_overrides(
        pipeline={"stages": 1, "micro_batches": micro_batches}, run={"precision": "bf16", "steps": last}
    )
    executor, schedule = build_executor(config, 0, device)
    runner = PlanRunner(executor, 0, schedule_plan(schedule), executor.tied)
    timer, scoped, off = BuildTimer(executor), executor.precision, Precision("fp32", device)
    runner.run_step(0)  # warm-up: lazy initialisation
    casts: dict[str, list[int]] = {}
    times: dict[str, list[float]] = {}
    for step in range(1, last):
        variant = variant_of(step)
        executor.precision = off if variant == "before" else scoped
        # the step before an "after" step prepares its micro-batches
        executor.steps = last if step + 1 < last and variant_of(step + 1) == "after" else None
        timer.seconds.clear()
        if step < 3:
            with WeightCasts() as counter:
                runner.run_step(step)
            casts[variant] = sorted(set(counter.counts.values()))
            continue
        result = runner.run_step(step)
        for name, value in (("", timer.seconds["inside"]), (" step", result.seconds)):
            times.setdefault(variant + name, []).append(1e3 * value)
        if timer.seconds["ahead"]:  # the next step's, built at the end of this one
            times.setdefault("ahead", []).append(1e3 * timer.seconds["ahead"])
    return {
        "run": path,
        "weights": len(counter.counts),
        "casts": casts,
        **{k: statistics.median(v) for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--run", action="append", help=f"run file, repeatable (default: {', '.join(RUNS)})")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    print(
        "| run | weights cast | casts per weight and step, before / after | micro-batch building in the step's ops "
        "(ms), before / after | built ahead at the step before's end (ms), after | step (ms), before / after |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for path in args.run or RUNS:
        with world_of_one("nccl" if device.type == "cuda" else "gloo", device):
            row = measure(path, device, args.micro_batches, args.steps)
        print(
            f"| {row['run']} | {row['weights']} | {row['casts']['before']} / {row['casts']['after']} "
            f"| {row['before']:.2f} / {row['after']:.2f} | {row['ahead']:.2f} "
            f"| {row['before step']:.1f} / {row['after step']:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "executor_host"))
