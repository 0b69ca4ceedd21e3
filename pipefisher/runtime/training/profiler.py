"""Measure a profile (pipefisher.profile/v2) of a run on the real executor.

Collective: every rank calls `measure_profile` with its executor. It runs warm-up and measured
steps that leave the model unchanged (gradients dropped) and times every op on every rank from a
common zero after a barrier (`Clock`: perf_counter on CPUs; CUDA events on GPUs, so an op's time
is the device's, without a host sync inside the step). It measures each stage boundary's transfer
with a ping-pong, each replicated stage's gradient reduction (under ZeRO-2/3, which
reduce-scatters inside the stage's last backward of a step, what that backward takes over the
stage's median backward: `_in_backward_reduce_times`), the rest of the end of step (tied weights,
clipping, optimizer step; parameters, optimizer state, learning-rate schedule and loss scale
restored after), and every task of the curvature method on the rank that holds it (its
`TaskTimer`; standalone regions are timed with the device synchronised before and after), with
the flops of each task where the method counts them and the device's rates they compare with,
from rank 0 (`task_flops`). Every rank gathers all
measurements and builds the same Profile, so every rank packs the same plan: each time is the
median of all ranks' samples of it, which the profile keeps (`samples`).
"""

from __future__ import annotations

import copy
import dataclasses
import platform
import statistics
from functools import partial
from collections import defaultdict
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from pipefisher.config import RunConfig
from pipefisher.core.ir import Op, OpKind
from pipefisher.core.profile import LayerProfile, Profile, StageProfile
from pipefisher.methods.interface import TaskTimer
from pipefisher.planning.comm.actions import Message
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.simulate import Interval, Timeline
from pipefisher.runtime.gradient_path.sharded import FsdpReduction
from pipefisher.runtime.primitives.clock import timed_ms
from pipefisher.runtime.pipeline.executor import Executor
from pipefisher.runtime.pipeline.extension import ExecutorExtension
from pipefisher.runtime.pipeline.plan_runner import schedule_plan
from pipefisher.runtime.primitives.tf32 import tf32_enabled
from pipefisher.runtime.training.task_flops import flop_rates, layer_flops, work_dtypes
from pipefisher.runtime.primitives.clock import Mark
from pipefisher.runtime.training.profile_sizes import weight_bytes, with_sizes

#: (rank, op string, start, end) in ms from the step's common zero
Record = tuple[int, str, float, float]
#: time field -> samples in ms
TimeSamples = dict[str, list[float]]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _summary(samples: Mapping[str, list[float]], keys: tuple[str, ...]) -> dict[str, Any]:
    """Keyword arguments of a profile entry: each of `keys` as the median of its samples (0 when
    it has none), and `samples` of the keys that have some, in `keys` order."""
    medians = {key: _median(samples.get(key, [])) for key in keys}
    return {**medians, "samples": {key: samples[key] for key in keys if samples.get(key)}}


class _Recording(ExecutorExtension):
    """The profiler's hooks during a measured step: every op's clock marks, and the timer's
    forward context (None: none) in place of the run's own hooks."""

    records = True

    def __init__(self, timer: TaskTimer | None):
        self.timer = timer
        self.marks: list[tuple[Op, Mark, Mark]] = []

    def forward_context(self, op: Op) -> AbstractContextManager:
        return self.timer.forward_context(op) if self.timer is not None else nullcontext()

    def record(self, op: Op, start: Mark, end: Mark) -> None:
        self.marks.append((op, start, end))


class _TimedStepEnd(ExecutorExtension):
    """The method's work before the optimizer step, as its timer does it (roots in place)."""

    def __init__(self, timer: TaskTimer):
        self.timer = timer

    def before_optimizer_step(self) -> None:
        self.timer.before_optimizer_step()


def _step_records(executor: Executor, rank: int, steps: int, timer: TaskTimer) -> list[list[Record]]:
    """Run `steps` gradient-dropping steps; per step, this rank's op records (ms from its start)."""
    topology = executor.topology
    # profiling steps drop their gradients: nothing to precondition and broadcast (K-FAC's gradient workers)
    path = dataclasses.replace(executor.gradient_path, workers_per_layer=None)
    plan = plan_actions(topology, schedule_plan(topology.schedule), executor.tied, path, recompute=executor.recompute)
    actions = replay(plan).steps[0][rank]
    clock = executor.clock
    records: list[list[Record]] = []
    for step in range(steps):
        dist.barrier()
        zero = clock.mark()
        # the last step's forwards may feed the task timings (K-FAC's captures)
        recording = _Recording(timer if step == steps - 1 else None)
        with executor.hooks_of(recording):
            executor.run_step(0, actions, update=False)
        records.append(
            [
                (rank, str(op), clock.elapsed_ms(zero, start), clock.elapsed_ms(zero, end))
                for op, start, end in recording.marks
            ]
        )
    return records


def _transfer_times(executor: Executor, rank: int, repeats: int = 5) -> dict[int, list[float]]:
    """stage -> samples of the ms to move its output to the next stage (half a ping-pong round
    trip: the activation forward on its channel, back on the gradients' channel)."""
    topology, comm = executor.topology, executor.comm
    times: dict[int, list[float]] = {}
    for stage in range(topology.schedule.num_stages - 1):
        a, b = topology.rank(0, 0, stage), topology.rank(0, 0, stage + 1)
        if rank not in (a, b) or a == b:
            continue
        shape, dtype = executor.message_spec(Message(Op(OpKind.FORWARD, stage + 1, 0)))
        buffer = torch.zeros(shape, dtype=dtype, device=executor.device)
        forward, backward = ("fwd", 0, 0, stage), ("bwd", 0, 0, stage)

        def ping_pong() -> None:
            if rank == a:
                comm.send(buffer, b, forward).wait()
                comm.recv(buffer, b, backward).wait()
            else:
                comm.recv(buffer, a, forward).wait()
                comm.send(buffer, a, backward).wait()

        ping_pong()  # connects
        times[stage] = [round_trip / 2 for round_trip in timed_ms(ping_pong, executor.device, repeats)]
    return times


def _grad_reduce_times(executor: Executor, repeats: int = 3) -> dict[int, list[float]]:
    """stage -> samples of the ms of its gradient reduction over its replicas (the buckets'
    all-reduces; with ZeRO-1 the reduces to the owners and the owners' parameter broadcasts; with
    PowerSGD its two all-reduces and their maths, its state restored afterwards), for every
    replicated stage this rank holds but those ZeRO-2/3 shards (`_sharded_stages`: no reduction
    outside a backward). Collective: stages in order on every rank."""
    step_end = executor.step_end
    step_end.begin(step_end.step, update=True)
    compression = step_end.reduction.state_dict()
    times: dict[int, list[float]] = {}
    sharded = _sharded_stages(executor)
    for stage in sorted({stage for _, stage in executor.stages}):
        if len(executor.topology.replica_ranks(stage)) < 2 or stage in sharded:
            continue
        step_end.reduce_now(stage)  # connects
        times[stage] = timed_ms(partial(step_end.reduce_now, stage), executor.device, repeats)
    step_end.reduction.load_state_dict(compression)
    executor.comm.sent_bytes.clear()
    return times


def _sharded_stages(executor: Executor) -> set[int]:
    """The stages of this rank that ZeRO-2/3 shards (FSDP2 reduce-scatters in their last backward)."""
    reduction = executor.step_end.reduction
    return set(reduction.stages) if isinstance(reduction, FsdpReduction) else set()


def _in_backward_reduce_times(steps: list[list[Record]], sharded: set[int]) -> dict[int, list[float]]:
    """stage -> samples of the ms of the gradient reduction of each stage in `sharded` (ZeRO-2/3),
    one per measured step of this rank (`steps`: its records): what the stage's last backward of
    the step, which reduce-scatters, takes over the median of its other backwards (0 when less;
    no sample with one micro-batch). The simulator adds it after that backward, where it runs;
    the profile's `backward` stays the median, which the one armed backward hardly moves."""
    times: dict[int, list[float]] = defaultdict(list)
    for records in steps:
        backwards: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for _, text, start, end in records:
            op = Op.parse(text)
            if op.kind is OpKind.BACKWARD and op.stage in sharded:
                backwards[op.stage].append((start, end - start))
        for stage, ops in backwards.items():
            *others, (_, last) = sorted(ops)
            if others:
                times[stage].append(max(0.0, last - _median([duration for _, duration in others])))
    return dict(times)


def _step_end_times(executor: Executor, timers: Sequence[TaskTimer | None], repeats: int = 3) -> list[list[float]]:
    """Per timer of `timers`, `repeats` samples of the ms of this rank's end of step after the
    gradient reduction (tied weights, the world reduction, clipping, the method's work before the
    optimizer step (none for a timer None), optimizer step) on gradients of ones (ZeRO-2/3: shards
    of ones), the timers taking turns in each round so that a drift of the machine's speed falls
    on all alike; parameters, optimizer state, learning-rate schedule and loss scale are restored
    afterwards. Collective."""
    step_end = executor.step_end
    parameters = [p for stage in executor.stages.values() for p in stage.module.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in parameters]
    optimizer_state = copy.deepcopy(step_end.optimizer.state_dict())
    scheduler_state = step_end.scheduler.state_dict() if step_end.scheduler is not None else None
    scaler_state = step_end.scaler.state_dict() if step_end.scaler is not None else None
    samples: list[list[float]] = [[] for _ in timers]
    step_end.begin(step_end.step, update=True)
    try:
        for _ in range(repeats + 1):  # the first round also allocates the optimizer's state
            for timer, found in zip(timers, samples):
                for buffer in step_end.buffers.values():
                    buffer.flat.fill_(1.0)  # global norm sqrt(n): clipping does scale
                if isinstance(step_end.reduction, FsdpReduction):
                    step_end.reduction.fill_(1.0)
                dist.barrier()
                with executor.hooks_of(*([_TimedStepEnd(timer)] if timer is not None else [])):
                    found.extend(timed_ms(step_end.apply_now, executor.device, repeats=1))
    finally:
        with torch.no_grad():
            for parameter, value in zip(parameters, saved):
                parameter.copy_(value)
        step_end.optimizer.load_state_dict(optimizer_state)
        if step_end.scheduler is not None and scheduler_state is not None:
            step_end.scheduler.load_state_dict(scheduler_state)
        if step_end.scaler is not None and scaler_state is not None:
            step_end.scaler.load_state_dict(scaler_state)
        for buffer in step_end.buffers.values():
            buffer.zero_()
        step_end.reduction.zero_()
    return [found[1:] for found in samples]


def _timed_step_ends(executor: Executor, timer: TaskTimer, repeats: int) -> tuple[list[float], list[float]]:
    """`repeats` samples of this rank's end of step with the method's work, in ms, and the
    method's own part of it (one sample: the median over rounds of the end of step with the
    work less the one without it, taken in turn, at least 0; none for a method whose timer has
    no work there, `TaskTimer.step_end_work`: K-FAC without gradient workers, Muon on
    unreplicated stages). Collective."""
    if not timer.step_end_work:
        return _step_end_times(executor, [timer], repeats)[0], []
    step_end, plain = _step_end_times(executor, [timer, None], repeats)
    return step_end, [max(0.0, _median([work - none for work, none in zip(step_end, plain)]))]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} thread(s) per rank"


def measured_at(config: RunConfig) -> dict[str, Any]:
    """`measure_profile`'s keywords that record what `config`'s profile is measured at, besides
    its micro-batch size and tensor-parallel degree (`run_profile.check_profile_matches` compares them)."""
    return {
        "recompute": config.model.recompute,
        "seq_len": config.model.seq_len,
        "precision": config.run.precision,
        "model": config.model.identity,
    }


def measure_profile(
    executor: Executor,
    rank: int,
    modules: dict[tuple[int, int], torch.nn.Module],
    micro_batch_size: int,
    timer: TaskTimer,
    warmup: int = 1,
    repeats: int = 3,
    recompute: str = "none",
    seq_len: int | None = None,
    precision: str | None = None,
    model: str = "",
) -> tuple[Profile, list[Record]]:
    """The run's profile (ms, medians, with their samples) and the op records of the last measured
    step, all ranks. `timer` measures the curvature method's tasks (`MethodParts.timer`);
    `recompute`: the run's `model.recompute`, which its backward times include; `seq_len`,
    `precision`, `model`: what else it is measured at, recorded in the profile (`measured_at`)."""
    records = _step_records(executor, rank, warmup + repeats, timer)
    transfers = _transfer_times(executor, rank)
    reduces = _grad_reduce_times(executor, repeats) | _in_backward_reduce_times(
        records[warmup:], _sharded_stages(executor)
    )
    tasks = timer.measure(executor)  # first: the step end then preconditions with the roots it leaves (Shampoo)
    step_end, method_step_end = _timed_step_ends(executor, timer, 2 * repeats + 1)  # noisier than an op: more samples
    held_stages = sorted({stage for _, stage in executor.stages})
    flops = layer_flops(timer, modules, tasks)
    dtypes = work_dtypes(flops.values(), executor.device)
    dist.barrier()  # the other ranks wait while rank 0 may time a matrix product alone
    rates = flop_rates(executor.device, device_name(executor.device), dtypes) if rank == 0 and dtypes else None
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered,
        (
            executor.comm.shard,
            records[warmup:],
            transfers,
            reduces,
            tasks,
            (held_stages, step_end, method_step_end),
            (flops, rates),
            weight_bytes(modules, tasks),
        ),
    )
    stage_samples: dict[int, TimeSamples] = defaultdict(lambda: defaultdict(list))
    layer_samples: dict[tuple[int, str], TimeSamples] = defaultdict(lambda: defaultdict(list))
    capture_bytes: dict[tuple[int, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    layer_order: dict[int, list[str]] = defaultdict(list)
    last_step: list[Record] = []
    counts: dict[tuple[int, str], dict[str, float]] = {}
    weights: dict[tuple[int, str], int] = {}
    for shard, rank_records, rank_transfers, rank_reduces, rank_tasks, (rank_stages, rank_step_end, rank_method), (
        rank_flops,
        rank_rates,
    ), rank_weights in gathered:
        weights.update(rank_weights)
        for key, tasks_flops in rank_flops.items():
            counts[key] = {time: task.total for time, task in tasks_flops.items()}
        rates = rates or rank_rates
        for stage, values in rank_transfers.items():
            stage_samples[stage]["p2p"].extend(values)
        for stage, values in rank_reduces.items():
            stage_samples[stage]["grad_reduce"].extend(values)
        for stage in rank_stages:  # a rank holding several stages pays their step ends together
            stage_samples[stage]["step_end"].extend(value / len(rank_stages) for value in rank_step_end)
            stage_samples[stage]["method_step_end"].extend(value / len(rank_stages) for value in rank_method)
        for step_records in rank_records:
            _add_compute_samples(step_records, stage_samples)
        if shard == 0:  # a rank's tensor-parallel processes run the same ops: the timeline shows a rank once
            last_step.extend(rank_records[-1])
        for (stage, layer), (samples, sizes) in rank_tasks.items():
            if layer not in layer_order[stage]:
                layer_order[stage].append(layer)
            for key, values in samples.items():
                layer_samples[(stage, layer)][key].extend(values)
            for part, size in sizes.items():
                capture_bytes[(stage, layer)][part] = max(capture_bytes[(stage, layer)][part], size)
    stages = []
    for stage in range(executor.topology.schedule.num_stages):
        layers = tuple(
            _layer(layer, layer_samples[(stage, layer)], capture_bytes[(stage, layer)], counts.get((stage, layer), {}))
            for layer in layer_order[stage]
        )
        summary = _summary(stage_samples[stage], StageProfile.TIME_FIELDS)
        summary["method_step_end"] = min(summary["method_step_end"], summary["step_end"])
        stages.append(StageProfile(**summary, layers=layers))
    profile = Profile(
        stages=tuple(stages),
        time_unit="ms",
        device=device_name(executor.device),
        micro_batch_size=micro_batch_size,
        tensor_parallel=executor.topology.tensor_parallel,
        method=timer.method,
        recompute=recompute,
        seq_len=seq_len,
        precision=precision,
        model=model,
        flop_rates=rates,
        tf32=tf32_enabled() if executor.device.type == "cuda" else None,
    )
    return with_sizes(profile, executor, weights), sorted(last_step)


def _layer(
    name: str, samples: Mapping[str, list[float]], sizes: Mapping[int, int], flops: Mapping[str, float]
) -> LayerProfile:
    """A layer's profile: each time key the timer measured as the median of its samples, and the
    `flops` of its tasks (by time key)."""
    summary = _summary(samples, tuple(sorted(samples)))
    captured = tuple(sizes.get(part, 0) for part in range(max(sizes, default=-1) + 1))
    times = {key: summary[key] for key in samples}
    return LayerProfile(name=name, capture_bytes=captured, samples=summary["samples"], flops=flops).with_times(times)


def _add_compute_samples(step_records: list[Record], stage_samples: dict[int, TimeSamples]) -> None:
    """Forward and backward times of one step's records; where the backward is split, a
    micro-batch's backward sample is its input plus its weight gradient, and `weight` the latter."""
    split: dict[tuple[int, int, int | None], float] = {}
    for _, text, start, end in step_records:
        op = Op.parse(text)
        if op.kind is OpKind.FORWARD:
            stage_samples[op.stage]["forward"].append(end - start)
        elif op.kind is OpKind.WEIGHT:
            stage_samples[op.stage]["weight"].append(end - start)
        if op.kind in (OpKind.BACKWARD, OpKind.WEIGHT):
            split[op.key] = split.get(op.key, 0.0) + end - start
    for (_, stage, _), seconds in sorted(split.items()):
        stage_samples[stage]["backward"].append(seconds)


def records_to_timeline(records: list[Record], num_ranks: int) -> Timeline:
    """A Timeline (ms, from the step's common zero) of op records."""
    per_rank: list[list[Interval]] = [[] for _ in range(num_ranks)]
    for rank, text, start, end in sorted(records, key=lambda r: (r[0], r[2])):
        per_rank[rank].append(Interval(Op.parse(text), start, end))
    return Timeline(ranks=tuple(tuple(ivs) for ivs in per_rank), time_unit="ms")
