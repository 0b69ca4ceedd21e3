"""Module-level functions that spawned ranks run (they must be importable by name), and the
check that a pipelined run equals its single-process reference."""

from __future__ import annotations

import os
import signal
import time
from unittest.mock import patch

import torch

from pipefisher.config import RunConfig
from pipefisher.core.ir import OpKind
from pipefisher.methods.registry import method_of
from pipefisher.runtime.training.trainer import TrainResult, build_executor, train_pipelined
from pipefisher.testing.harness import assert_equal_to_reference, pipelined  # noqa: F401  (the public harness; tests import them here)

CPU = torch.device("cpu")


def _break_backward(config: RunConfig, rank: int, fault) -> TrainResult:
    """Train, but rank 1 calls `fault()` at its backward of micro-batch 2 in the second step."""
    from pipefisher.runtime.pipeline.extension import ExecutorExtension

    executor, _ = build_executor(config, rank, CPU)
    backward = executor.handlers[OpKind.BACKWARD]

    class BrokenBackward(ExecutorExtension):
        def handlers(self):
            return {OpKind.BACKWARD: self.backward}

        def backward(self, op):
            if executor.current_step == 1 and op.micro_batch == 2:
                fault()
            return backward(op)

    if rank == 1:
        executor.extend(BrokenBackward())
    return train_pipelined(config, rank, CPU, executor=executor)


def _raise() -> None:
    raise ValueError("injected fault")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def raising(rank: int, world: int, config: RunConfig) -> TrainResult:
    return _break_backward(config, rank, _raise)


def killed(rank: int, world: int, config: RunConfig) -> TrainResult:
    return _break_backward(config, rank, _die)


def failing(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(60)


def hanging(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def bert_one_step(rank: int, world: int, config: RunConfig) -> TrainResult:
    return train_pipelined(config, rank, CPU)


def compiled_pipelined(rank: int, world: int, config: RunConfig) -> tuple[TrainResult, dict[str, int]]:
    """Train (`run.compile` compiles the stages' blocks); with the run, torch.compile's graphs
    (`graphs`) and graph breaks (`breaks`) in this rank."""
    from torch._dynamo.utils import counters

    result = train_pipelined(config, rank, CPU)
    return result, {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def checkpointing(rank: int, world: int, config: RunConfig, resume: bool) -> TrainResult:
    """Train with checkpoints; with `resume`, from the newest checkpoint that verifies."""
    from pipefisher.runtime.training.resumption import resumable_step

    start = resumable_step(config.checkpoint.dir, config)[0] if resume else None
    return train_pipelined(config, rank, CPU, resume_from=start)


def assert_resumes_bit_for_bit(config: RunConfig, stop_after: int, folder) -> str:
    """Train `config` straight through with a checkpoint after every step, and again in two parts
    (stopped after `stop_after` steps, then resumed from the newest checkpoint that verifies):
    the parts' losses are the straight run's and every rank's parameters equal its bit for bit.
    Returns the parted run's checkpoint folder."""
    from pathlib import Path

    from pipefisher.runtime.training.launch import run_group

    def train(directory: Path, resume: bool, steps: int | None = None) -> list[TrainResult]:
        part = config.with_overrides(checkpoint={"dir": str(directory), "every": 1}, run={"steps": steps})
        return run_group(checkpointing, config.world_size, args=(part, resume), timeout=30, deadline=240)

    straight = train(Path(folder) / "straight", False)
    parted = Path(folder) / "parted"
    first, second = train(parted, False, stop_after), train(parted, True)
    assert first[0].losses + second[0].losses == straight[0].losses
    for resumed, whole in zip(second, straight):
        assert all(torch.equal(value, whole.parameters[key]) for key, value in resumed.parameters.items())
    return str(parted)


def dies_while_saving(rank: int, world: int, config: RunConfig, fatal_step: int) -> TrainResult:
    """Train with checkpoints; rank 0 is killed half-way through writing the checkpoint of `fatal_step`."""
    from pipefisher.runtime.training import checkpoint

    original = checkpoint.torch.save

    def save(state, path):
        if rank == 0 and f"step-{fatal_step:06d}" in str(path):
            with open(path, "wb") as handle:
                handle.write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        original(state, path)

    checkpoint.torch.save = save
    return train_pipelined(config, rank, CPU)


def profiled_midway(rank: int, world: int, config: RunConfig, profile: bool) -> tuple[list[float], dict]:
    """Two steps, a profile measurement if `profile` (it must leave no trace), two more steps:
    the losses and this rank's final parameters and optimizer state."""
    from pipefisher.runtime.training.assembly import staged_model
    from pipefisher.runtime.pipeline.plan_runner import PlanRunner, schedule_plan
    from pipefisher.runtime.training.method_context import method_inputs
    from pipefisher.runtime.training.profiler import measure_profile

    executor, schedule = build_executor(config, rank, CPU)
    runner = PlanRunner(executor, rank, schedule_plan(schedule), executor.tied)
    losses = [runner.run_step(step).loss for step in range(2)]
    if profile:
        modules = {key: stage.module for key, stage in executor.stages.items()}
        parts = method_of(config).runtime_parts()
        timer = parts.timer(method_inputs(config), modules, parts.skip(staged_model(config)))
        measure_profile(executor, rank, modules, config.data.micro_batch_size, timer, repeats=2)
    losses += [runner.run_step(step).loss for step in range(2, 4)]
    state = {
        f"{key}.{name}": value.detach().clone()
        for key, stage in executor.stages.items()
        for name, value in stage.module.state_dict().items()
    }
    state["lr"] = executor.optimizer.param_groups[0]["lr"]
    return losses, state


def measured_profile(rank: int, world: int, config: RunConfig):
    """`measure_profile` of `config`'s method on a fresh executor (2 repeats): the profile every
    rank gets."""
    from pipefisher.runtime.training.assembly import staged_model
    from pipefisher.runtime.training.method_context import method_inputs
    from pipefisher.runtime.training.profiler import measure_profile

    executor, _ = build_executor(config, rank, CPU)
    modules = {key: stage.module for key, stage in executor.stages.items()}
    parts = method_of(config).runtime_parts()
    timer = parts.timer(method_inputs(config), modules, parts.skip(staged_model(config)))
    return measure_profile(executor, rank, modules, config.data.micro_batch_size, timer, repeats=2)[0]


def shared_channel_1f1b(rank: int, world: int, in_order: bool) -> str:
    """The issue order of the executor before the NCCL rework, for 1F1B on 2 stages, on one
    two-rank group: rank 0 `send a0 | recv g0 | send a1`, rank 1 `recv a0 | recv a1 | send g0`."""
    from pipefisher.runtime.primitives.comm import Comm

    comm = Comm({("p2p",): (0, 1)}, rank, in_order=in_order, timeout=5)
    a0, a1, g0 = torch.ones(4), torch.full((4,), 2.0), torch.full((4,), 3.0)
    if rank == 0:
        handles = [comm.send(a0, 1, ("p2p",))]
        received = torch.empty(4)
        handles.append(comm.recv(received, 1, ("p2p",)))
        handles.append(comm.send(a1, 1, ("p2p",)))
        for handle in handles:
            handle.wait()
        return f"g0={received[0].item():g}"
    first, second = torch.empty(4), torch.empty(4)
    handles = [comm.recv(first, 0, ("p2p",)), comm.recv(second, 0, ("p2p",))]
    handles[0].wait()
    handles.append(comm.send(g0, 0, ("p2p",)))
    for handle in handles:
        handle.wait()
    return f"a0={first[0].item():g} a1={second[0].item():g}"


def pipelined_with_records(rank: int, world: int, config: RunConfig) -> tuple[TrainResult, list[dict]]:
    """Train; also every step's logged fields (lr, grad_norm, overflow, ...) as this rank saw them."""
    records: list[dict] = []
    result = train_pipelined(config, rank, CPU, on_step=lambda step: records.append(dict(step.extra)))
    return result, records


def pipelined_with_budgets(
    rank: int, world: int, config: RunConfig, budgets: list[float]
) -> tuple[TrainResult, list[dict]]:
    """`pipelined_with_records` with this rank's own `run.time_budget_s`, `budgets[rank]`: ranks
    whose clocks disagree about the budget."""
    return pipelined_with_records(rank, world, config.with_overrides(run={"time_budget_s": budgets[rank]}))


def host_reads_per_step(rank: int, world: int, config: RunConfig) -> list[dict]:
    """Train `config.run.steps` steps; per step, the host reads of tensors on this rank by kind."""
    from host_reads import count_host_reads
    from pipefisher.runtime.training.pipefisher_run import PipeFisherTrainer
    from pipefisher.runtime.pipeline.plan_runner import PlanRunner, schedule_plan

    executor, schedule = build_executor(config, rank, CPU)
    if config.curvature is not None:
        runner = PipeFisherTrainer(config, executor, rank, executor.tied, unit_profile(config, schedule.num_stages))
    else:
        runner = PlanRunner(executor, rank, schedule_plan(schedule), executor.tied)
    counts = []
    for step in range(config.run.steps):
        with count_host_reads() as reads:
            runner.run_step(step)
        counts.append(dict(reads))
    return counts


def unit_profile(config: RunConfig, num_stages: int, inverse: float = 0.1, sync: float = 0.01):
    """A profile of the run's stages and the layers of its curvature method (K-FAC for first-order
    runs) with made-up times in ms (no measuring): forward 1, backward 2, curvature 0.01 per
    part, refresh work (inverses, roots) and syncs as given."""
    from builders import layered_profile
    from pipefisher.runtime.training.pipefisher_run import stage_layer_names

    names = [stage_layer_names(config, stage, num_stages) for stage in range(num_stages)]
    return layered_profile(
        num_stages,
        names=names,
        spread=False,
        curvature=0.01,
        inverse=inverse,
        precondition=0.01,
        sync=sync,
        method=method_of(config).name,
    )


def profiled_by_the_cli(run_file, folder, optimizer: str):
    """`pipefisher profile RUN_FILE --optimizer OPTIMIZER` (2 repeats): the profile it wrote into
    `folder` and its file's path."""
    import subprocess
    from pathlib import Path

    from pipefisher.core.profile import load_profile

    path = Path(folder) / f"{optimizer}.yaml"
    result = subprocess.run(
        [
            "pipefisher",
            "profile",
            str(run_file),
            "-o",
            str(path),
            "--master-port",
            "0",
            "--repeats",
            "2",
            "--optimizer",
            optimizer,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return load_profile(path), path


def powersgd_against_torch(rank: int, world: int, rank_r: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Reduce `steps` steps of random local gradients (the shapes of two Linears, a Conv1d and a
    LayerNorm) with pipefisher's PowerSGD and with torch's `powerSGD_hook` on a stand-in for DDP's
    bucket (start step 2, compression rate 1, the same first Q); per step (ours, torch's x world):
    pipefisher sums over replicas where DDP averages."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    from pipefisher.runtime.gradient_path.buffers import GradientBuffer
    from pipefisher.runtime.gradient_path.powersgd import PowerSGD

    module = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 16), nn.Conv1d(4, 6, 3), nn.LayerNorm(16))
    buffer = GradientBuffer(module, bucket_bytes=1 << 30)
    ours = PowerSGD(buffer, rank_r, seed=7)
    theirs_flat = torch.zeros_like(buffer.flat)
    theirs = [
        theirs_flat[offset - g.numel() : offset].view_as(g)
        for g, offset in zip(buffer.gradients, torch.tensor([g.numel() for g in buffer.gradients]).cumsum(0).tolist())
    ]
    state = torch_powersgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank_r,
        start_powerSGD_iter=2,
        min_compression_rate=1,
        use_error_feedback=True,
        warm_start=True,
    )
    # the same first Q (shapes differ, so torch's by-shape order is the parameters' order)
    state.p_memory_dict[0] = torch.empty(sum(p.numel() for p in ours.p))
    state.q_memory_dict[0] = ours.q_flat.clone()

    class Bucket:
        def index(self) -> int:
            return 0

        def buffer(self) -> torch.Tensor:
            return theirs_flat

        def gradients(self) -> list[torch.Tensor]:
            return theirs

        def is_last(self) -> bool:
            return True

    results = []
    for step in range(steps):
        local = torch.randn(buffer.flat.numel(), generator=torch.Generator().manual_seed(100 * step + rank))
        buffer.flat.copy_(local)
        theirs_flat.copy_(local)
        if step < 2:
            dist.all_reduce(buffer.flat)
        else:
            for factors in (ours.p_factors, ours.q_factors):
                for tensor in factors():
                    dist.all_reduce(tensor)
            ours.decompress()
        # the hook synchronises CUDA whenever a GPU is visible, whatever its tensors' device
        with patch.object(torch.cuda, "is_available", lambda: False):
            reduced = torch_powersgd.powerSGD_hook(state, Bucket()).wait()
        results.append((buffer.flat.clone(), reduced.clone() * world))
    return results


def counting_batches(rank: int, world: int, config: RunConfig) -> tuple[dict, dict]:
    """Train; (how often each (step, global micro-batch) was built on this rank, the names each
    micro-batch of the last step moved to the device)."""
    from collections import Counter

    executor, _ = build_executor(config, rank, CPU)
    built, build = Counter(), executor.micro_batch

    def counted(step: int, micro_batch: int):
        built[(step, micro_batch)] += 1
        return build(step, micro_batch)

    executor.micro_batch = counted
    train_pipelined(config, rank, CPU, executor=executor)
    return dict(built), {key: sorted(batch.moved) for key, batch in executor._batches.items()}


def fsdp_calls_per_step(rank: int, world: int, config: RunConfig) -> list[dict[str, int]]:
    """Train; per step, how many all-gathers and reduce-scatters FSDP2 issued on this rank (a
    counting wrapper around torch.distributed's calls, which still run)."""
    import torch.distributed as dist

    counts: dict[str, int] = {"all_gather": 0, "reduce_scatter": 0}
    steps: list[dict[str, int]] = []

    def counted(name: str, call):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return call(*args, **kwargs)

        return wrapper

    with (
        patch.object(dist, "all_gather_single", counted("all_gather", dist.all_gather_single)),
        patch.object(dist, "reduce_scatter_single", counted("reduce_scatter", dist.reduce_scatter_single)),
    ):

        def on_step(result) -> None:
            steps.append(dict(counts))
            counts.update(dict.fromkeys(counts, 0))

        train_pipelined(config, rank, CPU, on_step=on_step)
    return steps
