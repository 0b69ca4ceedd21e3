"""Step time of ZeRO-3 against ZeRO-1 (docs/zero_memory.md, section "ZeRO-2/3 with FSDP2",
"Step time"), measured side by side and as `pipefisher plan` predicts it.

GPT-2 tiny (schedules/gpt2-tiny-cpu.yaml) on 1 stage x 2 replicas (2 gloo processes, one thread
each), 1F1B, AdamW, `--micro-batches` of `--micro-batch-size`: one run file with
`optimizer.zero: 1`, one with 3. Measured: one group of 2 processes builds both runs side by side
(same seed and data), warms each up (`--warmup` steps), then `--rounds` rounds in which each runs
one timed block of `--steps` steps, their order alternating from round to round, a barrier before
each block; a block's sample is the slower rank's wall time / its steps (ms). The ratio
ZeRO-3 / ZeRO-1 of each round and their median (range over the rounds). Predicted: `pipefisher
profile` of the same model on 2 stages x 1 replica (no gradient reduction in it: the compute,
and the stage boundary's transfer, whose bandwidth `plan` takes for the data-parallel traffic),
then `pipefisher plan RUN_FILE --gpus 2 --profile PROFILE --method adamw --json` of each run
file: its `run_file_layout` step time and modelled reduction (ZeRO-1: the all-reduce's ring bytes;
ZeRO-3: the reduce-scatter's and every forward's and backward's all-gathers') at plan's
data-parallel bandwidth. Takes about 3 minutes on a loaded 2-core machine.

    python experiments/zero_step_time.py
    python experiments/zero_step_time.py --rounds 3 --steps 2 --micro-batch-size 2   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

import torch  # noqa: E402
import yaml  # noqa: E402

from experiments.common import experiment_output, progress  # noqa: E402
from experiments.exposed.group import Block  # noqa: E402
from experiments.plan_check import call  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402
from pipefisher.config import RunConfig, load_config  # noqa: E402
from pipefisher.runtime.training import PlanRunner, build_executor, run_group, schedule_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN_FILE = ROOT / "schedules" / "gpt2-tiny-cpu.yaml"
ZEROS = (1, 3)
#: run.steps of both runs: only the learning-rate schedule's length (the timed steps never reach it)
RUN_STEPS = 100_000
#: bound of any wait inside the group [s]
GROUP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Timing:
    """`warmup` untimed steps per run, then `rounds` rounds of one block of `steps` steps per run."""

    warmup: int
    rounds: int
    steps: int


def run_file(folder: Path, name: str, stages: int, replicas: int, zero: int, args: argparse.Namespace) -> Path:
    """gpt2-tiny-cpu.yaml laid out on `stages` x `replicas` with `optimizer.zero` written to `folder`."""
    data = yaml.safe_load(RUN_FILE.read_text())
    data["pipeline"].update(stages=stages, data_parallel=replicas, micro_batches=args.micro_batches)
    data["data"]["micro_batch_size"] = args.micro_batch_size
    data["optimizer"]["zero"] = zero
    data["run"].update(steps=RUN_STEPS, backend="gloo", timeout=GROUP_TIMEOUT_S, master_port=0)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def timed_runs(rank: int, world: int, configs: dict[int, RunConfig], timing: Timing) -> dict[int, list[float]]:
    """ZeRO degree -> ms per step of each round (module docstring); collective on the group."""
    runners, steps = {}, dict.fromkeys(configs, 0)
    for zero, config in configs.items():
        executor, schedule = build_executor(config, rank, torch.device("cpu"))
        executor.steps = RUN_STEPS  # each step prepares the next one's micro-batches, as in a run
        runners[zero] = PlanRunner(executor, rank, schedule_plan(schedule), executor.tied)

    def run(zero: int, count: int) -> None:
        for _ in range(count):
            runners[zero].run_step(steps[zero])
            steps[zero] += 1

    for zero in configs:
        run(zero, timing.warmup)
    step_ms: dict[int, list[float]] = {zero: [] for zero in configs}
    for round_ in range(timing.rounds):
        order = list(configs) if round_ % 2 == 0 else list(reversed(list(configs)))
        for zero in order:
            with Block() as block:
                run(zero, timing.steps)
            step_ms[zero].append(1000 * block.seconds / timing.steps)
        if rank == 0:
            progress(
                f"round {round_ + 1}/{timing.rounds}: "
                + ", ".join(f"ZeRO-{zero} {step_ms[zero][-1]:.0f} ms/step" for zero in configs)
            )
    return step_ms


def predicted(run_files: dict[int, Path], profile: Path, args: argparse.Namespace) -> dict[int, dict]:
    """ZeRO degree -> `pipefisher plan --json`'s prediction of the run file's own layout."""
    found = {}
    bandwidth = ["--dp-bandwidth-gbps", str(args.dp_bandwidth_gbps)] if args.dp_bandwidth_gbps else []
    for zero, path in run_files.items():
        command = [sys.executable, "-m", "pipefisher", "plan", str(path), "--gpus", "2", *bandwidth]
        command += ["--memory-gb", str(args.memory_gb), "--profile", str(profile), "--method", "adamw", "--json"]
        layout = json.loads(call(command))["run_file_layout"]
        if layout is None:
            raise RuntimeError(f"pipefisher plan {path.name}: the run file's layout was not predicted")
        found[zero] = layout
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9, medians)")
    parser.add_argument("--steps", type=int, default=2, help="steps per run and round (default 2)")
    parser.add_argument("--profile-repeats", type=int, default=3, help="measured steps of the profile (default 3)")
    parser.add_argument("--memory-gb", type=float, default=8.0, help="plan's memory per process, GiB (default 8)")
    parser.add_argument(
        "--dp-bandwidth-gbps",
        type=float,
        help="plan's data-parallel bandwidth, GB/s (default: plan's own, from the profile's stage-boundary transfer)",
    )
    parser.add_argument("--out", type=Path, help="folder of the run files and profile (default: a temporary one)")
    args = parser.parse_args()
    folder = args.out or experiment_output("zero_step_time")
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    run_files = {zero: run_file(folder, f"zero{zero}", 1, 2, zero, args) for zero in ZEROS}
    profile = folder / "profile-2x1.yaml"
    progress("measuring the profile (pipefisher profile, 2 stages x 1 replica)")
    call(
        [sys.executable, "-m", "pipefisher", "profile", str(run_file(folder, "profiled", 2, 1, 0, args))]
        + ["-o", str(profile), "--master-port", "0", "--repeats", str(args.profile_repeats)]
    )
    plans = predicted(run_files, profile, args)
    configs = {zero: load_config(path) for zero, path in run_files.items()}
    timing = Timing(args.warmup, args.rounds, args.steps)
    step_ms = run_group(timed_runs, 2, args=(configs, timing), timeout=GROUP_TIMEOUT_S)[0]
    ratios = [three / one for one, three in zip(step_ms[1], step_ms[3])]
    print(
        f"GPT-2 tiny, 1 stage x 2 replicas (gloo, 1 thread per process), 1F1B, {args.micro_batches} micro-batches "
        f"of {args.micro_batch_size} x {configs[1].model.seq_len} tokens, AdamW; {args.rounds} rounds of {args.steps} "
        f"steps per run, alternated; {time.perf_counter() - started:.0f} s"
    )
    print("| ZeRO | measured (ms/step, median) | predicted (ms/step) | predicted reduction (ms/step) |")
    print("| --- | ---: | ---: | ---: |")
    for zero in ZEROS:
        plan = plans[zero]
        print(f"| {zero} | {statistics.median(step_ms[zero]):.0f} | {plan['step_ms']:.1f} | {plan['reduce_ms']:.1f} |")
    print(
        f"ZeRO-3 / ZeRO-1: measured {statistics.median(ratios):.3f} (median of {len(ratios)} rounds, "
        f"{min(ratios):.3f}-{max(ratios):.3f}); predicted by pipefisher plan {plans[3]['step_ms'] / plans[1]['step_ms']:.3f}"
    )
    print(f"run files and profile in {folder}")


if __name__ == "__main__":
    sys.exit(entry_point(main, "zero_step_time"))
