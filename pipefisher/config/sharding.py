"""The rules of `optimizer.zero` 2 and 3 (parameter and gradient sharding by PyTorch's FSDP2 over
each stage's data-parallel replicas): what this release runs and, for the rest, the one-line
reason and fix. Pure Python: no torch."""

from __future__ import annotations

from pipefisher.config.sections import PipelineConfig, RunSettings
from pipefisher.core.ir import ScheduleError
from pipefisher.methods.method import CurvatureMethod
from pipefisher.optim.settings import OptimizerConfig
from pipefisher.schedules import chunks_per_rank, get_schedule

#: the first-order rules that step FSDP2's sharded parameters as they would whole ones
SHARDABLE_RULES = ("sgd", "adamw")


def fsdp_problem(
    optimizer: OptimizerConfig, pipeline: PipelineConfig, run: RunSettings, method: CurvatureMethod | None
) -> str:
    """Why a run of these sections cannot shard parameters and gradients (optimizer.zero 2 or 3),
    with the fix; "" when it can or does not ask to. `method`: the curvature method optimizer.name
    names (None: a first-order rule)."""
    zero = optimizer.zero
    if zero < 2:
        return ""
    head = f"optimizer.zero: {zero} (FSDP2)"
    name = optimizer.name
    if method is not None and not method.shards:
        return f"{head} with {name} comes later (its runtime reads whole gradients); use optimizer.zero 1 or 0"
    if method is None and name not in SHARDABLE_RULES:
        return (
            f"{head} with {name}: its trust ratio needs whole-parameter norms, which FSDP2's shards cut; "
            "use optimizer.name adamw or optimizer.zero 1"
        )
    try:
        chunks = chunks_per_rank(pipeline.schedule, pipeline.chunks)
        schedule = get_schedule(pipeline.schedule, pipeline.stages, pipeline.micro_batches, chunks)
    except ScheduleError:
        return ""  # the schedule's own error comes where the run builds it
    if schedule.splits_backward:
        return (
            f"{head} under {pipeline.schedule}: its weight gradients run outside the backward whose hooks make "
            "FSDP2 reduce-scatter them; use pipeline.schedule 1f1b, gpipe or interleaved, or optimizer.zero 1"
        )
    if schedule.num_pipes > 1 and pipeline.data_parallel < 2:
        return (
            f"{head} under {pipeline.schedule} shards over a pipe's data-parallel replicas (its pipes' copies of a stage "
            "run at different times); set pipeline.data_parallel 2 or more, or optimizer.zero 1"
        )
    if run.precision == "fp16":
        return f"{head} with run.precision fp16 comes later; use run.precision bf16 or fp32, or optimizer.zero 1"
    if run.compile:
        return f"{head} with compiled blocks comes later; set run.compile false or optimizer.zero 1"
    return ""
