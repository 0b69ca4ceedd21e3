"""The two-stage arms, each a fresh training run of `BenchSettings.steps` steps on two local
processes; both return the first step's loss and the seconds of the steps after the warm-up.

`pipefisher_run`: the command line, `python -m pipefisher run FILE --json --master-port 0` with
the comparison's overrides as flags (it launches its 2 ranks itself); the time is the sum of
rank 0's reported step times (`step_time_ms`) of the timed steps.

`pipelining_run`: `torch.distributed.pipelining` as its docs teach it, in a group of 2 processes
(pipefisher's `run_group` only spawns them): each rank wraps its stage module
(`build_stage(rank, 2, seed)`, the same modules pipefisher trains) in a `PipelineStage` (shapes
inferred at the first step) driven by `Schedule1F1B` with M micro-batches (`scale_grads`: the
mean over micro-batches, as pipefisher's loss). The step's micro-batches, concatenated, go to
`step()` as keyword arguments, which the schedule splits into the same micro-batches for every
stage (stage 0 embeds the token ids, every stage reads the attention mask); the target is the
rows' indices, from which the loss function takes the rows' labels. Then what pipefisher's end
of step does, by hand: the gradients of the tied embedding/decoder copies summed across the
two ranks (all-reduce), global-norm clipping over both ranks (all-reduce of the squared norms,
the tied weight counted once), optimizer step, scheduler, zero_grad. The time is the slower
rank's wall time of the timed steps (a barrier before them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.config import RunConfig
from pipefisher.runtime.training import build_optimizer, build_run, build_scheduler, run_group

from experiments.common import RunFailed
from experiments.overhead.one_stage import compiled
from experiments.overhead.workloads import ROOT, BenchSettings, Workload


def pipefisher_run(
    workload: Workload, settings: BenchSettings, warmup: int, backend: str, timeout: float
) -> tuple[float, float]:
    """(first step's loss, seconds of the steps after `warmup`) of one `pipefisher run`."""
    command = [
        sys.executable,
        "-m",
        "pipefisher",
        "run",
        workload.run_file,
        "--json",
        "--master-port",
        "0",
        *settings.flags(workload, backend),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RunFailed(f"pipefisher run exited with {done.returncode}: {last}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(records) != settings.steps:
        raise RunFailed(f"pipefisher run reported {len(records)} steps, not {settings.steps}")
    return records[0]["loss"], sum(record["step_time_ms"] for record in records[warmup:]) / 1000


class PipeliningModule(nn.Module):
    """A pipefisher stage module as `PipelineStage` calls it: the previous stage's activation as
    the positional argument (none on stage 0), the micro-batch's tensors as keyword arguments."""

    def __init__(self, stage: nn.Module, bf16: bool, device: torch.device):
        super().__init__()
        self.stage = stage
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else nullcontext

    def forward(self, *activation: torch.Tensor, **batch: torch.Tensor):
        with self.autocast():
            return self.stage(activation[0] if activation else None, batch)


def pipelining_worker(rank: int, world: int, config: RunConfig, warmup: int, compile_blocks: bool) -> dict:
    """One rank of `pipelining_run`; {"loss": first step's loss (last rank), "seconds": slower rank's timed steps}."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    device = torch.device("cuda", rank) if config.run.backend == "nccl" else torch.device("cpu")
    run = build_run(config)
    model = run.model
    module = model.build_stage(rank, world, config.run.seed).to(device)
    if compile_blocks:
        compiled(module)
    last, micro_batches = rank == world - 1, config.pipeline.micro_batches
    whole: dict[str, torch.Tensor] = {}

    def loss_fn(output, rows: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.run.precision == "bf16"):
            return model.loss(output, {name: tensor[rows] for name, tensor in whole.items()})[0]

    stage = PipelineStage(PipeliningModule(module, config.run.precision == "bf16", device), rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=loss_fn)
    optimizer = build_optimizer(config, [module])
    scheduler = build_scheduler(config, optimizer)
    parameters = dict(module.named_parameters())
    tied = [
        parameters[name] for where, name in model.tied_parameters() if name in parameters and (where == "last") == last
    ]
    counted = [p for p in module.parameters() if not (last and any(p is t for t in tied))]
    batch = run.data_source
    clip = config.optimizer.clip_norm

    def step(index: int) -> float:
        parts = [batch(index, micro_batch) for micro_batch in range(micro_batches)]
        whole.clear()
        whole.update({name: torch.cat([part[name] for part in parts]).to(device) for name in parts[0]})
        losses: list[torch.Tensor] = []
        if last:
            rows = torch.arange(next(iter(whole.values())).shape[0], device=device)
            schedule.step(**whole, target=rows, losses=losses, return_outputs=False)
        else:
            schedule.step(**whole, return_outputs=False)
        for parameter in tied:
            dist.all_reduce(parameter.grad)
        if clip > 0:
            squares = torch.stack([p.grad.detach().float().square().sum() for p in counted if p.grad is not None]).sum()
            dist.all_reduce(squares)
            scale = (clip / (squares.sqrt() + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([p.grad for p in module.parameters() if p.grad is not None], scale)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if last else float("nan")

    first = step(0)
    for index in range(1, warmup):
        step(index)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for index in range(warmup, config.run.steps):
        step(index)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return {"loss": first, "seconds": float(seconds)}


def pipelining_run(
    workload: Workload, settings: BenchSettings, warmup: int, backend: str, timeout: float
) -> tuple[float, float]:
    """(first step's loss, slower rank's seconds of the steps after `warmup`) of one torch.distributed.pipelining run."""
    config = settings.config(workload, backend)
    results = run_group(
        pipelining_worker,
        2,
        args=(config, warmup, settings.compile),
        backend=backend,
        timeout=config.run.timeout,
        deadline=timeout,
    )
    return results[-1]["loss"], results[0]["seconds"]
