"""pipefisher's executor against PyTorch's own `torch.distributed.pipelining`, on this machine.

`--ranks` ranks (default 2; gloo on 127.0.0.1, one thread each), the same model (pipefisher's
Transformer stages from `TinyRegression.build_stage`, same seed), the same micro-batch size and count, the
same synthetic data, SGD step included in both. For every schedule of `--schedules`, pipefisher's
schedule of that name and its PyTorch counterpart run side by side in one process group; the default,

    pipefisher GPipe, torch ScheduleGPipe, pipefisher 1F1B, torch Schedule1F1B

compares one pipeline stage per rank. The zero-bubble schedules (issue 18) pair as follows
(`PAIRS` below):

    zb-h1      torch ScheduleInterleavedZeroBubble, one stage per rank (torch's ZB1P, which is ZB-H1
               when each rank holds one stage: F, then I (input gradient) and W (weight gradient))
    zbv        torch ScheduleZBVZeroBubble, two stages per rank in a V (rank r holds r and 2D-1-r)
    dualpipev  torch ScheduleDualPipeV, two stages per rank in a V (needs N >= 2D micro-batches)

The model is cut into as many stages as the schedule places (2D for the V schedules, so `--layers`
must be a multiple of 2D there). A schedule pipefisher does not register (yet) runs torch's side only,
and says so.

Each variant does `--warmup` untimed steps first (its first step is also the loss sanity check:
every variant starts from the same parameters and sees the same data: their losses must agree
to 1e-5). Then, `--repeats` times, the variants run `--steps` timed steps each, one after the
other (order reversed on odd repeats, A B C D D C B A …, to cancel drift), with a barrier between
variants. A sample is the slower rank's wall time of the block divided by `--steps`; the table
reports the median sample of each variant, the ratio of the medians pipefisher / torch per
schedule (lower is better) and, less noisy, the median over repeats of the ratio of the two
back-to-back samples of that schedule. The machine's load average is printed with the results:
other processes on the cores make every sample noisier.

Torch is used as a user would: `PipelineStage` with example tensors (input requires_grad only
past stage 0, output requires_grad), `loss_fn` on every rank, `target=` on the last stage,
`return_outputs=False`, the whole batch (the N micro-batches concatenated) handed to `step`,
then `optimizer.step()` / `zero_grad()`; its data preparation is inside the timed step, as
pipefisher's is. A rank that holds several stages (V schedules) builds one `PipelineStage` per
stage and hands the list to the schedule, as torch's multi-stage schedules expect.

`--profile` adds, per variant, where the time of a step goes on each rank (receive waits vs the
rest), measured by wrapping functions of this process only (nothing in the package is changed).

Usage: python experiments/bench_executor.py [--schedules gpipe 1f1b] [--ranks 2] [--micro-batches 4 8]
       [--repeats 7] [--steps 3] [--warmup 2] [--micro-batch-size 4] [--hidden 256] [--heads 4]
       [--ffn 1024] [--seq-len 128] [--layers 4] [--profile]
Zero bubble: python experiments/bench_executor.py --schedules 1f1b zb-h1 zbv
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch import nn
from torch.nn import functional as F

from pipefisher.config import config_from_dict
from pipefisher.data.synthetic import SyntheticRegression
from pipefisher.models.tiny import TinyRegression
from pipefisher.runtime.training import PlanRunner, build_executor, build_optimizer, run_group, schedule_plan
from pipefisher.cli.scripts import entry_point


@dataclass(frozen=True)
class Pair:
    """PyTorch's counterpart of a pipefisher schedule: its class in `torch.distributed.pipelining`,
    how many model stages each rank holds, and where torch places them (`generate_stage_to_rank_mapping`)."""

    torch_name: str
    stages_per_rank: int = 1
    style: str = "loop"

    @property
    def multi(self) -> bool:
        """Whether the torch class takes a list of stages (`PipelineScheduleMulti`) rather than one."""
        return self.torch_name not in ("ScheduleGPipe", "Schedule1F1B")


PAIRS = {
    "gpipe": Pair("ScheduleGPipe"),
    "1f1b": Pair("Schedule1F1B"),
    # torch's ZB1P with one stage per rank is ZB-H1 (F, I = input gradient, W = weight gradient)
    "zb-h1": Pair("ScheduleInterleavedZeroBubble"),
    "zbv": Pair("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": Pair("ScheduleDualPipeV", 2, "v"),
}
DEFAULT_SCHEDULES = ("gpipe", "1f1b")


def pipefisher_has(schedule: str) -> bool:
    """Whether pipefisher registers `schedule` (the zero-bubble ones land with issue 18)."""
    from pipefisher.schedules import SCHEDULES as REGISTERED

    return schedule in REGISTERED


def torch_stages_of(pair: Pair, rank: int, ranks: int) -> list[int]:
    """The model stages torch places on `rank`, in stage order."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    mapping = generate_stage_to_rank_mapping(ranks, ranks * pair.stages_per_rank, style=pair.style)
    return sorted(stage for stage, owner in mapping.items() if owner == rank)


def make_config(args: dict, schedule: str, micro_batches: int):
    """pipefisher's run configuration; torch's side reads the model, data and optimizer from it."""
    return config_from_dict(
        {
            "model": {
                "kind": "transformer",
                "layers": args["layers"],
                "hidden": args["hidden"],
                "heads": args["heads"],
                "ffn": args["ffn"],
                "seq_len": args["seq_len"],
                "input_dim": 16,
                "output_dim": 4,
            },
            "data": {"kind": "synthetic", "seed": 0, "micro_batch_size": args["micro_batch_size"]},
            "pipeline": {
                "schedule": schedule,
                "stages": args["ranks"],
                "micro_batches": micro_batches,
                "data_parallel": 1,
            },
            "optimizer": {"name": "sgd", "lr": 0.05},
            "run": {"steps": 1, "seed": 0, "backend": "gloo", "timeout": 120},
        }
    )


# -- instrumentation (this process only) ------------------------------------------------------
class Timers:
    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.enabled = False

    def wrap(self, owner, name: str, label: str):
        original = getattr(owner, name)
        timers = self

        def wrapper(*a, **k):
            if not timers.enabled:
                return original(*a, **k)
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                timers.totals[label] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    def take(self) -> dict[str, float]:
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals


def install_profiling(timers: Timers) -> None:
    from torch.distributed.pipelining import stage as torch_stage

    from pipefisher.runtime.primitives import comm as pf_comm
    from pipefisher.runtime.pipeline import stage as pf_stage
    from pipefisher.runtime.gradient_path import step_end as pf_step_end

    # pipefisher
    timers.wrap(pf_comm.Handle, "wait", "pf: comm wait")
    timers.wrap(pf_comm.Comm, "call", "pf: post comm")
    timers.wrap(pf_stage.StageRuntime, "forward", "pf: forward")
    timers.wrap(pf_stage.StageRuntime, "backward", "pf: backward")
    if hasattr(pf_stage.StageRuntime, "weight"):  # W of the zero-bubble schedules
        timers.wrap(pf_stage.StageRuntime, "weight", "pf: weight gradient")
    timers.wrap(pf_step_end.StepEnd, "finish", "pf: optimizer step")
    # torch: the schedule waits on p2p works via _wait_batch_p2p / work.wait
    from torch.distributed.pipelining import schedules as torch_schedules

    if hasattr(torch_schedules, "_wait_batch_p2p"):
        timers.wrap(torch_schedules, "_wait_batch_p2p", "torch: recv/send wait")
    if hasattr(torch_schedules, "_batch_p2p"):
        timers.wrap(torch_schedules, "_batch_p2p", "torch: post p2p")
    timers.wrap(torch_stage._PipelineStageBase, "forward_one_chunk", "torch: forward")
    timers.wrap(torch_stage._PipelineStageBase, "backward_one_chunk", "torch: backward")
    if hasattr(torch_stage._PipelineStageBase, "backward_weight_one_chunk"):
        timers.wrap(torch_stage._PipelineStageBase, "backward_weight_one_chunk", "torch: weight gradient")
    if hasattr(torch_stage._PipelineStageBase, "scale_grads"):
        timers.wrap(torch_stage._PipelineStageBase, "scale_grads", "torch: scale grads")


# -- variants ---------------------------------------------------------------------------------
class PipefisherVariant:
    def __init__(self, config, rank: int):
        executor, schedule = build_executor(config, rank, torch.device("cpu"))
        self.runner = PlanRunner(executor, rank, schedule_plan(schedule), executor.tied)
        self.step_index = 0

    def step(self) -> float:
        result = self.runner.run_step(self.step_index)
        self.step_index += 1
        return result.loss  # the step loss: mean of the micro-batch losses, on every rank


class TorchStage(nn.Module):
    """pipefisher's stage module as torch.distributed.pipelining calls it: one tensor in, one out."""

    def __init__(self, stage: nn.Module, first: bool):
        super().__init__()
        self.stage, self.first = stage, first

    def forward(self, x):
        return self.stage(None, {"inputs": x}) if self.first else self.stage(x, {})


def mse(output, target):
    return F.mse_loss(output, target)


class TorchVariant:
    def __init__(self, config, rank: int, pair: Pair):
        from torch.distributed import pipelining

        model, n = config.model, config.pipeline.micro_batches
        mbs, ranks = config.data.micro_batch_size, config.pipeline.stages
        num_stages = ranks * pair.stages_per_rank
        held = torch_stages_of(pair, rank, ranks)
        self.n = n
        self.first, self.last = 0 in held, num_stages - 1 in held
        self.modules = [
            TorchStage(TinyRegression(model).build_stage(index, num_stages, config.run.seed), index == 0)
            for index in held
        ]
        stages = []
        for index, module in zip(held, self.modules):
            in_width = model.input_dim if index == 0 else model.hidden
            out_width = model.output_dim if index == num_stages - 1 else model.hidden
            example_in = torch.empty(mbs, model.seq_len, in_width).requires_grad_(index > 0)
            example_out = torch.empty(mbs, model.seq_len, out_width).requires_grad_(True)
            stages.append(
                pipelining.PipelineStage(
                    module, index, num_stages, torch.device("cpu"), input_args=example_in, output_args=example_out
                )
            )
        cls = getattr(pipelining, pair.torch_name)
        # loss_fn on every rank; scale_grads=True -> mean over micro-batches, as pipefisher's loss
        self.schedule = cls(stages if pair.multi else stages[0], n_microbatches=n, loss_fn=mse)
        self.optimizer = build_optimizer(config, self.modules)
        self.data = SyntheticRegression(config.data, config.model)
        self.step_index = 0

    def step(self) -> float:
        batches = [self.data.micro_batch(self.step_index, mb) for mb in range(self.n)]
        self.step_index += 1
        inputs = (torch.cat([batch["inputs"] for batch in batches]),) if self.first else ()
        loss = float("nan")
        if self.last:
            losses: list = []
            self.schedule.step(
                *inputs, target=torch.cat([batch["targets"] for batch in batches]), losses=losses, return_outputs=False
            )
            loss = sum(float(item.detach()) for item in losses) / len(losses)
        else:
            self.schedule.step(*inputs, return_outputs=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def variant_names(schedules, missing=()) -> list[str]:
    """The variants of a run, pipefisher's and torch's of each schedule side by side (torch's alone
    for the schedules in `missing`, which pipefisher does not register)."""
    names = []
    for schedule in schedules:
        if schedule not in missing:
            names.append(f"pipefisher {schedule}")
        names.append(f"torch {schedule}")
    return names


def worker(rank: int, world: int, args: dict, micro_batches: int) -> dict:
    torch.set_num_threads(1)
    timers = Timers()
    if args["profile"]:
        install_profiling(timers)
    variants = {}
    for name in variant_names(args["schedules"], args["missing"]):
        side, schedule = name.split(" ", 1)
        if side == "pipefisher":
            variants[name] = PipefisherVariant(make_config(args, schedule, micro_batches), rank)
        else:  # torch reads the model, data, optimizer and pipeline size of the config, not its schedule
            variants[name] = TorchVariant(make_config(args, "1f1b", micro_batches), rank, PAIRS[schedule])
    order = list(variants)
    # interleave: pf gpipe, torch gpipe, pf 1f1b, torch 1f1b, ...
    first_loss, warm = {}, {}
    for name in order:
        dist.barrier()
        start = time.perf_counter()
        for k in range(args["warmup"]):
            loss = variants[name].step()
            if k == 0:
                first_loss[name] = loss
        warm[name] = (time.perf_counter() - start) / max(args["warmup"], 1)
    samples: dict[str, list[float]] = {name: [] for name in order}
    profiles: dict[str, dict[str, float]] = {name: defaultdict(float) for name in order}
    for repeat in range(args["repeats"]):
        for name in order if repeat % 2 == 0 else order[::-1]:
            dist.barrier()
            timers.take()
            timers.enabled = True
            start = time.perf_counter()
            for _ in range(args["steps"]):
                variants[name].step()
            elapsed = time.perf_counter() - start
            timers.enabled = False
            for label, seconds in timers.take().items():
                profiles[name][label] += seconds / args["steps"] / args["repeats"]
            slowest = torch.tensor([elapsed], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            samples[name].append(float(slowest) / args["steps"])
    dist.barrier()
    return {
        "rank": rank,
        "samples": samples,
        "first_loss": first_loss,
        "warmup": warm,
        "profiles": {k: dict(v) for k, v in profiles.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=list(PAIRS),
        default=list(DEFAULT_SCHEDULES),
        help="pipefisher schedules, each run beside its torch counterpart (see PAIRS)",
    )
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks (processes)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per repeat")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="also print where step time goes (wrapped calls)")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds allowed per group run")
    ns = parser.parse_args()
    ranks, schedules = ns.ranks, list(dict.fromkeys(ns.schedules))
    if ranks < 2:
        parser.error("--ranks: a pipeline needs at least 2 ranks")
    if ns.warmup < 1:
        parser.error("--warmup: at least 1 (the first step checks the losses)")
    if min(ns.micro_batches) < ranks:
        parser.error(f"Schedule1F1B needs at least {ranks} micro-batches")
    if "dualpipev" in schedules and min(ns.micro_batches) < 2 * ranks:
        parser.error(f"ScheduleDualPipeV needs at least {2 * ranks} micro-batches (as many as stages)")
    pieces = math.lcm(*(ranks * PAIRS[s].stages_per_rank for s in schedules))
    if ns.layers % pieces:
        parser.error(f"--layers {ns.layers} cannot be cut into {pieces} equal stages (the schedules' stage counts)")
    args = {
        k: getattr(ns, k)
        for k in (
            "schedules",
            "ranks",
            "repeats",
            "steps",
            "warmup",
            "micro_batch_size",
            "hidden",
            "heads",
            "ffn",
            "seq_len",
            "layers",
            "profile",
        )
    }
    missing = [s for s in schedules if not pipefisher_has(s)]  # decided once, here: every rank runs the same variants
    args.update(schedules=schedules, missing=missing)

    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"torch {torch.__version__}; {ranks} ranks, gloo 127.0.0.1, torch.set_num_threads(1) per rank; "
        f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} over 1, 5, 15 min"
    )
    cuts = ", ".join(
        f"{s} {ranks * PAIRS[s].stages_per_rank} stages ({ns.layers // (ranks * PAIRS[s].stages_per_rank)} blocks each)"
        for s in schedules
    )
    print(
        f"model: transformer layers {ns.layers} ({cuts}), hidden {ns.hidden}, heads {ns.heads}, "
        f"ffn {ns.ffn}, seq_len {ns.seq_len}, input 16, output 4; micro-batch size {ns.micro_batch_size}; SGD lr 0.05"
    )
    print(
        f"timing: warm-up {ns.warmup} steps/variant, then {ns.repeats} repeats x {ns.steps} steps/variant, "
        f"variants alternated (order reversed on odd repeats); sample = slower rank's block time / steps"
    )
    for schedule in missing:
        print(f"note: pipefisher registers no schedule {schedule!r} yet: torch {PAIRS[schedule].torch_name} runs alone")
    print()

    rows = []
    for n in ns.micro_batches:
        started = time.perf_counter()
        results = run_group(worker, ranks, args=(args, n), backend="gloo", timeout=300, deadline=ns.deadline)
        wall = time.perf_counter() - started
        samples = results[0]["samples"]
        medians = {name: statistics.median(values) for name, values in samples.items()}
        # sanity: first-step loss of every variant (same init, same data), from a rank that holds the
        # last stage (the last rank, or rank 0 for torch's V schedules)
        first_loss = {
            name: next(
                (r["first_loss"][name] for r in results[::-1] if not math.isnan(r["first_loss"][name])), math.nan
            )
            for name in samples
        }
        reference = next(iter(first_loss.values()))
        differences = [abs(v - reference) / abs(reference) for v in first_loss.values()]
        worst = math.nan if any(map(math.isnan, differences)) else max(differences)
        print(
            f"N = {n} micro-batches (group run {wall:.0f} s; load average of this machine now "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} over 1, 5, 15 min)"
        )
        print("  first-step loss: " + ", ".join(f"{k} {v:.8f}" for k, v in first_loss.items()))
        print(f"  max relative difference {worst:.2e} -> {'OK' if worst <= 1e-5 else 'MISMATCH'} (tolerance 1e-5)")
        for name, values in samples.items():
            print(
                f"  {name:20s} samples ms: "
                + " ".join(f"{1e3 * v:.1f}" for v in values)
                + f" | median {1e3 * medians[name]:.1f} | warm-up {1e3 * results[0]['warmup'][name]:.1f}"
            )
        if ns.profile:
            for result in results:
                for name, profile in result["profiles"].items():
                    parts = ", ".join(f"{label.split(': ')[1]} {1e3 * s:.1f}" for label, s in sorted(profile.items()))
                    print(f"  profile rank {result['rank']} {name:20s} ms/step: {parts}")
        for schedule in schedules:
            tc_samples, tc = samples[f"torch {schedule}"], medians[f"torch {schedule}"]
            if schedule in missing:
                rows.append((schedule, n, None, tc, None, None))
                continue
            pf_samples, pf = samples[f"pipefisher {schedule}"], medians[f"pipefisher {schedule}"]
            # the two samples of a repeat ran back to back, on the same machine state: their ratio is
            # less exposed to the machine's slow/fast phases than the ratio of medians
            paired = statistics.median(a / b for a, b in zip(pf_samples, tc_samples))
            print(f"  {schedule}: ratio of medians {pf / tc:.3f}, median of paired ratios {paired:.3f}")
            rows.append((schedule, n, pf, tc, pf / tc, paired))
        print()

    def cell(value, scale=1.0, digits=1):
        return "n/a" if value is None else f"{scale * value:.{digits}f}"

    print("| schedule | N | pipefisher median ms | torch median ms | ratio pipefisher/torch | paired ratio (median) |")
    print("|---|---|---|---|---|---|")
    for schedule, n, pf, tc, ratio, paired in rows:
        label = f"{schedule} (torch {PAIRS[schedule].torch_name})"
        print(
            f"| {label} | {n} | {cell(pf, 1e3)} | {cell(tc, 1e3)} | {cell(ratio, digits=3)} | {cell(paired, digits=3)} |"
        )
    print()
    compared = [row for row in rows if row[4] is not None]
    if compared:
        print(
            "target: ratio <= 1.05; "
            + ", ".join(
                f"{s} N={n}: {'met' if r <= 1.05 else 'NOT met'} (paired {'met' if p <= 1.05 else 'NOT met'})"
                for s, n, _, _, r, p in compared
            )
        )


if __name__ == "__main__":
    sys.exit(entry_point(main, "bench_executor"))
