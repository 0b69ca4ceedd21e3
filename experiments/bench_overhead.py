"""Framework overhead: pipefisher against plain PyTorch on the same model, micro-batches and
optimizer, in tokens/s (and MFU on a GPU).

Arms (`--arms`):
  one-stage  pipefisher with one stage (its executor and plan runner in this process, a
             process group of one: gloo on the CPU, NCCL on cuda:0) against the plain PyTorch
             loop with gradient accumulation (`overhead.one_stage`).
  two-stage  `pipefisher run FILE --json` with 2 stages (2 local processes it launches) against
             `torch.distributed.pipelining` (PipelineStage + Schedule1F1B, 2 processes) on the
             same two stage modules (`overhead.two_stage`); both run 1F1B with M micro-batches.
Both sides build the model with pipefisher's staged model (`build_stage`), train on
`build_run(config).data_source`'s micro-batches with the optimizer and learning-rate schedule pipefisher
builds for the run (AdamW fused, or pipefisher's LAMB), clip as the run file says and read each
step's loss; their first-step losses are compared as a check that they train the same thing.

Timing: each side does `--warmup` untimed steps, then, `--repeats` times, `--steps` timed steps
(one-stage: both sides built once in this process, taking turns step by step, the first side
swapped on odd repeats; two-stage: per repeat one fresh run of each side, one after the other,
the order swapped on odd repeats, warm-up steps left out).
tokens/s = steps x tokens per step (micro-batches x sequences x sequence length, padding
included) / seconds; the table gives each side's median over repeats and the median over
repeats of pipefisher's tokens/s over the baseline's of the same repeat (1.000 = as fast, below
1 = pipefisher slower). CPU runs use one thread per process. MFU (CUDA only): model FLOPs per
step (`overhead.flops`: 6 x matmul weights x tokens + 12 x layers x hidden x seq_len^2 per
sequence) x steps / seconds / the devices' peak dense bf16 FLOP/s (H100 SXM 989e12, H100 PCIe
756e12, H200 989e12, A100 312e12; another device: no MFU, and a note says so).

    python experiments/bench_overhead.py --out docs/overhead.md            # the CPU run (~12 min on 2 cores)
    python experiments/bench_overhead.py --device cuda --precision bf16 --out /tmp/overhead-gpu.md
    python experiments/bench_overhead.py --quick --arms one-stage          # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.common import UsageError, listed, progress  # noqa: E402
from experiments.overhead.flops import peak_bf16, step_flops  # noqa: E402
from experiments.overhead.one_stage import PipefisherOneStage, PlainLoop, alternating_steps, timed_steps  # noqa: E402
from experiments.overhead.report import Comparison, table  # noqa: E402
from experiments.overhead.two_stage import RunFailed, pipefisher_run, pipelining_run  # noqa: E402
from experiments.overhead.workloads import CPU_MODELS, GPU_MODELS, WORKLOADS, BenchSettings, Workload  # noqa: E402
from pipefisher.runtime.training import GroupFailure, Interrupted, build_run, tokens_per_step, world_of_one  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402

OPTIMIZERS = ("adamw", "lamb")
ARMS = ("one-stage", "two-stage")
RUN_TIMEOUT_S = 1200.0  # one two-stage run, start-up included


def flops_and_peak(config, device: torch.device, devices: int) -> tuple[float | None, float | None]:
    """Model FLOPs per step and the summed peak of `devices` GPUs (None, None off CUDA)."""
    if device.type != "cuda":
        return None, None
    model = build_run(config).model
    peak = peak_bf16(torch.cuda.get_device_name(device))
    return step_flops(config, model, model.build_stage(0, 1, config.run.seed)), peak * devices if peak else None


def compare_one_stage(workload: Workload, optimizer: str, args, device: torch.device) -> Comparison:
    settings = BenchSettings(
        optimizer,
        args.precision,
        args.warmup + args.repeats * args.steps,
        1,
        args.compile,
        args.quick,
        args.micro_batch_size,
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    config = settings.config(workload, backend)
    flops, peak = flops_and_peak(config, device, 1)
    comparison = Comparison(
        workload.name,
        optimizer,
        "one-stage",
        "plain PyTorch loop",
        tokens_per_step(config),
        args.steps,
        flops_per_step=flops,
        peak=peak,
    )
    with world_of_one(backend, device):
        arms = {"baseline": PlainLoop(config, device, args.compile), "pipefisher": PipefisherOneStage(config, device)}
        for side, arm in arms.items():
            comparison.first_losses[side] = arm.step()
            timed_steps(arm, args.warmup - 1, device)
        for repeat in range(args.repeats):
            order = list(arms) if repeat % 2 == 0 else list(arms)[::-1]
            for side, seconds in alternating_steps({side: arms[side] for side in order}, args.steps, device).items():
                getattr(comparison, f"{side}_seconds").append(seconds)
            progress(f"{comparison.latest()} (repeat {repeat + 1}/{args.repeats})")
    return comparison


def compare_two_stage(workload: Workload, optimizer: str, args, device: torch.device) -> Comparison:
    settings = BenchSettings(
        optimizer, args.precision, args.warmup + args.steps, 2, args.compile, args.quick, args.micro_batch_size
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    config = settings.config(workload, backend)
    flops, peak = flops_and_peak(config, device, 2)
    comparison = Comparison(
        workload.name,
        optimizer,
        "two-stage",
        "torch.distributed.pipelining Schedule1F1B",
        tokens_per_step(config),
        args.steps,
        flops_per_step=flops,
        peak=peak,
    )
    runs = {"baseline": pipelining_run, "pipefisher": pipefisher_run}
    for repeat in range(args.repeats):
        order = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
        for side in order:
            loss, seconds = runs[side](workload, settings, args.warmup, backend, RUN_TIMEOUT_S)
            comparison.first_losses.setdefault(side, loss)
            getattr(comparison, f"{side}_seconds").append(seconds)
        progress(f"{comparison.latest()} (repeat {repeat + 1}/{args.repeats})")
    return comparison


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: {','.join(CPU_MODELS)} "
        f"on the CPU, {','.join(GPU_MODELS)} on CUDA, bert-tiny with --quick)",
    )
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated, of adamw, lamb")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of one-stage, two-stage")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per side per repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    parser.add_argument("--repeats", type=int, default=7, help="paired repeats (default 7; the ratio is their median)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks (run.compile; compile_blocks)")
    parser.add_argument(
        "--micro-batch-size", type=int, default=None, help="sequences per micro-batch (default: the run file's)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 2 micro-batches of 2, 1 repeat, 2 steps, 1 warm-up"
    )
    parser.add_argument(
        "--out", type=Path, help="write the table here (markdown) and the measurements beside it (.json)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 2, 1
    for flag in ("steps", "warmup", "repeats"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag}: {getattr(args, flag)} is not a positive count")
    default_models = ("bert-tiny",) if args.quick else GPU_MODELS if args.device == "cuda" else CPU_MODELS
    args.models = listed(args.models, list(WORKLOADS), "--models") if args.models else list(default_models)
    args.optimizers = listed(args.optimizers, OPTIMIZERS, "--optimizers")
    args.arms = listed(args.arms, ARMS, "--arms")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no GPU here; use --device cpu")
    if args.device == "cuda" and "two-stage" in args.arms and torch.cuda.device_count() < 2:
        raise UsageError(
            f"--arms two-stage on cuda needs 2 GPUs (one NCCL rank each), this machine has "
            f"{torch.cuda.device_count()}; use --arms one-stage or --device cpu"
        )
    if args.compile:
        try:
            from pipefisher.runtime.training import compile_blocks  # noqa: F401
        except ImportError:
            raise UsageError(
                "--compile needs run.compile (pipefisher.runtime.pipeline.compiled.compile_blocks), "
                "which this checkout lacks"
            ) from None
    return args


def header(args: argparse.Namespace, device: torch.device, comparisons: list[Comparison]) -> list[str]:
    """The lines above the table: the command, the machine and what the numbers are."""
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({os.cpu_count()} cores, 1 thread per process)"
    )
    lines = [
        "# Framework overhead: pipefisher against plain PyTorch",
        "",
        "Written by `experiments/bench_overhead.py` (its docstring has the method). Back to the [README](../README.md).",
        "",
        "- one-stage: pipefisher's executor with pipeline.stages 1 (a process group of one) against the plain PyTorch loop "
        "with gradient accumulation, in one process;",
        "- two-stage: `pipefisher run --json` with 2 stages against `torch.distributed.pipelining` (PipelineStage, "
        "Schedule1F1B), 2 processes each; both 1F1B over the same two stage modules.",
        "",
        "Same model (pipefisher's `build_stage`), micro-batches (`data_source`), optimizer and learning-rate schedule "
        "(pipefisher's `build_optimizer`: AdamW fused or pipefisher's LAMB), clipping at the run file's norm; the last "
        "column checks that both sides' first steps agree.",
        "",
        f"Command: `python {shlex.join(['experiments/bench_overhead.py', *sys.argv[1:]])}`",
        "",
        f"torch {torch.__version__}, {name}, precision {args.precision}"
        f"{', torch.compile of the blocks' if args.compile else ''}; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) at the end: other processes shared the machine.",
        f"{args.warmup} warm-up steps, then {args.repeats} repeats x {args.steps} timed steps per side (one-stage: the sides "
        "take turns step by step; two-stage: one fresh run of each side per repeat); tokens/s: median over repeats; "
        "ratio: median over repeats of pipefisher's tokens/s / the baseline's (paired, 1.000 = as fast).",
    ]
    if device.type == "cuda" and any(c.peak is None for c in comparisons):
        lines.append(f"MFU omitted: no peak dense bf16 rate known for {name} (pipefisher/core/peaks.py PEAKS).")
    elif device.type == "cuda":
        lines.append(
            "MFU: model FLOPs (6 x matmul weights x tokens + 12 x layers x hidden x seq_len^2 per sequence) / time / "
            "the devices' peak dense bf16 FLOP/s."
        )
    return lines


def compare(args: argparse.Namespace, device: torch.device) -> list[Comparison]:
    """Every comparison of the run: per model, per optimizer, the arms asked for."""
    comparisons = []
    for name in args.models:
        workload = WORKLOADS[name]
        # the tokenizer and tokens, built once and cached on disk before any arm starts
        settings = BenchSettings(args.optimizers[0], args.precision, 1, 1, quick=args.quick)
        build_run(settings.config(workload, "gloo")).data_source  # noqa: B018 (built now: cached on disk)
        for optimizer in args.optimizers:
            if "one-stage" in args.arms:
                comparisons.append(compare_one_stage(workload, optimizer, args, device))
            if "two-stage" in args.arms:
                comparisons.append(compare_two_stage(workload, optimizer, args, device))
    return comparisons


def main() -> int:
    try:
        args = parse()
    except UsageError as exc:
        print(f"bench_overhead: error: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as every rank of the two-stage arms
    started = time.perf_counter()
    try:
        comparisons = compare(args, device)
    except (RunFailed, GroupFailure) as exc:
        print(f"bench_overhead: {exc}", file=sys.stderr)
        return 1
    except Interrupted as exc:
        print(f"bench_overhead: {exc}", file=sys.stderr)
        return exc.exit_code
    text = "\n".join([*header(args, device, comparisons), "", table(comparisons), ""])
    print(text)
    progress(f"bench_overhead: {time.perf_counter() - started:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(
            json.dumps(
                {
                    "command": sys.argv,
                    "device": str(device),
                    "torch": torch.__version__,
                    "precision": args.precision,
                    "comparisons": [c.as_dict() for c in comparisons],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "bench_overhead"))
