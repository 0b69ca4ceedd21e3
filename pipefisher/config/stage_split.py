"""How a run's model is cut into stages, as the configuration checks and says it: the stage count's
terms, `pipeline.stage_blocks`' counts, the divisors that would split evenly. Pure Python."""

from __future__ import annotations

from pipefisher.config.sections import PipelineConfig
from pipefisher.core.settings import ConfigError
from pipefisher.schedules import CONFIGURABLE_CHUNKS, chunks_per_rank


def stage_count_terms(pipeline: PipelineConfig) -> tuple[str, str]:
    """How the run's stage count per pipe is made, for messages: (its factors with their values,
    the product to fix), e.g. ("pipeline.stages 2 x pipeline.chunks 3", "pipeline.stages x
    pipeline.chunks") for interleaved, ("pipeline.stages 2 x 2 chunks per rank of zbv",
    "2 x pipeline.stages") for a V schedule, ("pipeline.stages 2", "pipeline.stages") otherwise."""
    stages = f"pipeline.stages {pipeline.stages}"
    if pipeline.schedule in CONFIGURABLE_CHUNKS:
        return f"{stages} x pipeline.chunks {pipeline.chunks}", "pipeline.stages x pipeline.chunks"
    chunks = chunks_per_rank(pipeline.schedule)
    if chunks > 1:
        return f"{stages} x {chunks} chunks per rank of {pipeline.schedule}", f"{chunks} x pipeline.stages"
    return stages, "pipeline.stages"


def check_stage_blocks(pipeline: PipelineConfig, kind: str, blocks: int, counted_by: str, uneven: bool = True) -> None:
    """ConfigError naming `pipeline.stage_blocks` unless it gives one count per model stage (stages
    x chunks per rank) that sum to the model's `blocks` (0: not known from the run file;
    `counted_by` names what counts them), for a model kind (`kind`) whose stages take it (`uneven`)."""
    counts = pipeline.stage_blocks
    if not uneven:
        raise ConfigError(
            f"pipeline.stage_blocks: model.kind {kind} splits its blocks evenly; drop pipeline.stage_blocks"
        )
    model_stages = pipeline.stages * chunks_per_rank(pipeline.schedule, pipeline.chunks)
    factors, _ = stage_count_terms(pipeline)
    if len(counts) != model_stages:
        raise ConfigError(
            f"pipeline.stage_blocks: {len(counts)} counts for {model_stages} model stages ({factors}); "
            "give one count per stage"
        )
    if blocks and sum(counts) != blocks:
        raise ConfigError(
            f"pipeline.stage_blocks: {list(counts)} sums to {sum(counts)}, but the model has {blocks} blocks ({counted_by})"
        )


def split_hint(layers: int, what: str) -> str:
    """How to fix a stage count that does not divide `layers`: name the divisors."""
    divisors = [str(d) for d in range(1, layers + 1) if layers % d == 0]
    listed = divisors[0] if len(divisors) == 1 else ", ".join(divisors[:-1]) + " or " + divisors[-1]
    return f"make {what} a divisor of {layers}: {listed}"
