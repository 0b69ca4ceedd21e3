"""pipefisher's executor against PyTorch's own `torch.distributed.pipelining`, on this machine.

Two ranks (gloo on 127.0.0.1, one thread each), one pipeline stage per rank, the same model
(pipefisher's Transformer stages from `TinyRegression.build_stage`, same seed), the same micro-batch size and
count, the same synthetic data, SGD step included in both. Four variants run side by side in one
2-process group:

    pipefisher GPipe, torch ScheduleGPipe, pipefisher 1F1B, torch Schedule1F1B

Each variant does `--warmup` untimed steps first (its first step is also the loss sanity check:
every variant starts from the same parameters and sees the same data). Then, `--repeats` times,
the variants run `--steps` timed steps each, one after the other (order reversed on odd repeats,
A B C D D C B A …, to cancel drift), with a barrier between variants. A sample is the slower
rank's wall time of the block divided by `--steps`; the table reports the median sample of each
variant, the ratio of the medians pipefisher / torch per schedule (lower is better) and, less
noisy, the median over repeats of the ratio of the two back-to-back samples of that schedule.

Torch is used as a user would: `PipelineStage` with example tensors (input requires_grad only
past stage 0, output requires_grad), `loss_fn` on every rank, `target=` on the last stage,
`return_outputs=False`, the whole batch (the N micro-batches concatenated) handed to `step`,
then `optimizer.step()` / `zero_grad()`. Its data preparation is inside the timed step, as
pipefisher's is.

`--profile` adds, per variant, where the time of a step goes on each rank (receive waits vs the
rest), measured by wrapping functions of this process only (nothing in the package is changed).

Usage: python experiments/bench_executor.py [--micro-batches 4 8] [--repeats 7] [--steps 3]
       [--warmup 2] [--micro-batch-size 4] [--hidden 256] [--heads 4] [--ffn 1024]
       [--seq-len 128] [--layers 4] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from torch import nn
from torch.nn import functional as F

from pipefisher.config import config_from_dict
from pipefisher.data.synthetic import SyntheticRegression
from pipefisher.models.tiny import TinyRegression
from pipefisher.optim import build_optimizer
from pipefisher.runtime.launch import run_group
from pipefisher.runtime.plan_runner import PlanRunner, schedule_plan
from pipefisher.runtime.training import build_executor

STAGES = 2
SCHEDULES = ("gpipe", "1f1b")
TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def make_config(args: dict, schedule: str, micro_batches: int):
    return config_from_dict(
        {
            "model": {
                "kind": "transformer", "layers": args["layers"], "hidden": args["hidden"], "heads": args["heads"],
                "ffn": args["ffn"], "seq_len": args["seq_len"], "input_dim": 16, "output_dim": 4,
            },
            "data": {"kind": "synthetic", "seed": 0, "micro_batch_size": args["micro_batch_size"]},
            "pipeline": {"schedule": schedule, "stages": STAGES, "micro_batches": micro_batches, "data_parallel": 1},
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

    from pipefisher.runtime import comm as pf_comm
    from pipefisher.runtime import stage as pf_stage
    from pipefisher.runtime import step_end as pf_step_end

    # pipefisher
    timers.wrap(pf_comm.Handle, "wait", "pf: comm wait")
    timers.wrap(pf_comm.Comm, "call", "pf: post comm")
    timers.wrap(pf_stage.StageRuntime, "forward", "pf: forward")
    timers.wrap(pf_stage.StageRuntime, "backward", "pf: backward")
    timers.wrap(pf_step_end.StepEnd, "finish", "pf: optimizer step")
    # torch: the schedule waits on p2p works via _wait_batch_p2p / work.wait
    from torch.distributed.pipelining import schedules as torch_schedules

    if hasattr(torch_schedules, "_wait_batch_p2p"):
        timers.wrap(torch_schedules, "_wait_batch_p2p", "torch: recv/send wait")
    if hasattr(torch_schedules, "_batch_p2p"):
        timers.wrap(torch_schedules, "_batch_p2p", "torch: post p2p")
    timers.wrap(torch_stage._PipelineStageBase, "forward_one_chunk", "torch: forward")
    timers.wrap(torch_stage._PipelineStageBase, "backward_one_chunk", "torch: backward")
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
    def __init__(self, config, rank: int, schedule_name: str):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        model, n = config.model, config.pipeline.micro_batches
        mbs = config.data.micro_batch_size
        self.rank, self.n = rank, n
        self.first, self.last = rank == 0, rank == STAGES - 1
        self.module = TorchStage(TinyRegression(model).build_stage(rank, STAGES, config.run.seed), self.first)
        in_width = model.input_dim if self.first else model.hidden
        out_width = model.output_dim if self.last else model.hidden
        example_in = torch.empty(mbs, model.seq_len, in_width).requires_grad_(rank > 0)
        example_out = torch.empty(mbs, model.seq_len, out_width).requires_grad_(True)
        stage = PipelineStage(self.module, rank, STAGES, torch.device("cpu"), input_args=example_in, output_args=example_out)
        cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
        self.schedule = cls(stage, n_microbatches=n, loss_fn=mse)  # loss_fn on every rank; scale_grads=True -> mean
        self.optimizer = build_optimizer(config.optimizer, [self.module])
        self.data = SyntheticRegression(config.data, config.model)
        self.step_index = 0

    def step(self) -> float:
        batches = [self.data.micro_batch(self.step_index, mb) for mb in range(self.n)]
        self.step_index += 1
        if self.first:
            self.schedule.step(torch.cat([batch["inputs"] for batch in batches]), return_outputs=False)
            loss = float("nan")
        else:
            losses: list = []
            self.schedule.step(target=torch.cat([batch["targets"] for batch in batches]), losses=losses, return_outputs=False)
            loss = sum(float(l.detach()) for l in losses) / len(losses)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def worker(rank: int, world: int, args: dict, micro_batches: int) -> dict:
    torch.set_num_threads(1)
    timers = Timers()
    if args["profile"]:
        install_profiling(timers)
    variants = {}
    for name in SCHEDULES:
        variants[f"pipefisher {name}"] = PipefisherVariant(make_config(args, name, micro_batches), rank)
        variants[f"torch {name}"] = TorchVariant(make_config(args, name, micro_batches), rank, name)
    order = list(variants)
    # interleave: pf gpipe, torch gpipe, pf 1f1b, torch 1f1b
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
    return {"rank": rank, "samples": samples, "first_loss": first_loss, "warmup": warm,
            "profiles": {k: dict(v) for k, v in profiles.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    if min(ns.micro_batches) < STAGES:
        parser.error(f"Schedule1F1B needs at least {STAGES} micro-batches")
    args = {k: getattr(ns, k) for k in ("repeats", "steps", "warmup", "micro_batch_size", "hidden", "heads", "ffn",
                                         "seq_len", "layers", "profile")}

    print(f"command: python {' '.join(sys.argv)}")
    print(f"torch {torch.__version__}; {STAGES} ranks, gloo 127.0.0.1, torch.set_num_threads(1) per rank")
    print(f"model: transformer layers {ns.layers} ({ns.layers // STAGES}/stage), hidden {ns.hidden}, heads {ns.heads}, "
          f"ffn {ns.ffn}, seq_len {ns.seq_len}, input 16, output 4; micro-batch size {ns.micro_batch_size}; SGD lr 0.05")
    print(f"timing: warm-up {ns.warmup} steps/variant, then {ns.repeats} repeats x {ns.steps} steps/variant, "
          f"variants alternated (order reversed on odd repeats); sample = slower rank's block time / steps")
    print()

    rows = []
    for n in ns.micro_batches:
        started = time.perf_counter()
        results = run_group(worker, STAGES, args=(args, n), backend="gloo", timeout=300, deadline=ns.deadline)
        wall = time.perf_counter() - started
        samples = results[0]["samples"]
        medians = {name: statistics.median(values) for name, values in samples.items()}
        # sanity: first-step loss of every variant (same init, same data); torch's is on the last rank
        last = results[-1]["first_loss"]
        reference = last["pipefisher gpipe"]
        print(f"N = {n} micro-batches (group run {wall:.0f} s)")
        print("  first-step loss (last rank): " + ", ".join(f"{k} {v:.8f}" for k, v in last.items()))
        worst = max(abs(v - reference) / abs(reference) for v in last.values())
        print(f"  max relative difference {worst:.2e} -> {'OK' if worst <= 1e-5 else 'MISMATCH'} (tolerance 1e-5)")
        for name, values in samples.items():
            print(f"  {name:18s} samples ms: " + " ".join(f"{1e3 * v:.1f}" for v in values)
                  + f" | median {1e3 * medians[name]:.1f} | warm-up {1e3 * results[0]['warmup'][name]:.1f}")
        if ns.profile:
            for result in results:
                for name, profile in result["profiles"].items():
                    parts = ", ".join(f"{label.split(': ')[1]} {1e3 * s:.1f}" for label, s in sorted(profile.items()))
                    print(f"  profile rank {result['rank']} {name:18s} ms/step: {parts}")
        for schedule in SCHEDULES:
            pf_samples, tc_samples = samples[f"pipefisher {schedule}"], samples[f"torch {schedule}"]
            pf, tc = medians[f"pipefisher {schedule}"], medians[f"torch {schedule}"]
            # the two samples of a repeat ran back to back, on the same machine state: their ratio is
            # less exposed to the machine's slow/fast phases than the ratio of medians
            paired = statistics.median(a / b for a, b in zip(pf_samples, tc_samples))
            print(f"  {schedule}: ratio of medians {pf / tc:.3f}, median of paired ratios {paired:.3f}")
            rows.append((schedule, n, pf, tc, pf / tc, paired))
        print()

    print("| schedule | N | pipefisher median ms | torch median ms | ratio pipefisher/torch | paired ratio (median) |")
    print("|---|---|---|---|---|---|")
    for schedule, n, pf, tc, ratio, paired in rows:
        label = f"{schedule} (torch {TORCH_NAMES[schedule]})"
        print(f"| {label} | {n} | {1e3 * pf:.1f} | {1e3 * tc:.1f} | {ratio:.3f} | {paired:.3f} |")
    print()
    print("target: ratio <= 1.05; " + ", ".join(
        f"{s} N={n}: {'met' if r <= 1.05 else 'NOT met'} (paired {'met' if p <= 1.05 else 'NOT met'})"
        for s, n, _, _, r, p in rows))


if __name__ == "__main__":
    main()
