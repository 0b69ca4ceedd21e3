"""The layouts a GPU count allows: stages x data-parallel x tensor-parallel = GPUs, every schedule
that can be built at that shape, micro-batch sizes a time source can give, the global batch held
fixed, the gradient path where there are replicas (ZeRO-1; ZeRO-2 and 3 where FSDP2 runs the layout
with the planned optimizer, `fsdp_allowed`; PowerSGD), and the recompute modes. Pure Python: no torch.

A layout's global batch (samples per optimizer step) is micro_batch_size x micro_batches x
data_parallel; every layout of one search has the run file's, so step times compare per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from pipefisher.config import OptimizerConfig, PipelineConfig, RunSettings
from pipefisher.config.run import recompute_problem
from pipefisher.config.sharding import fsdp_problem
from pipefisher.core.ir import Schedule, ScheduleError
from pipefisher.core.stage_split import counts_text
from pipefisher.core.names import RECOMPUTE_MODES
from pipefisher.methods.registry import methods
from pipefisher.methods.settings import RefreshConfig
from pipefisher.planning.planner.model_sizes import ModelSizes
from pipefisher.schedules import CONFIGURABLE_CHUNKS, DEFAULT_CHUNKS, SCHEDULES, chunks_per_rank, get_schedule

#: the largest tensor-parallel degree enumerated (one node's GPUs)
MAX_TENSOR_PARALLEL = 8


@dataclass(frozen=True)
class Layout:
    """One way to run the model: `stages` pipeline ranks (D) x `data_parallel` copies x
    `tensor_parallel` processes per rank = GPUs; the schedule with `chunks` model chunks per rank;
    `micro_batches` of `micro_batch_size` samples per pipeline and step; ZeRO (`zero`: 0 off, 1-3) and
    PowerSGD (`powersgd_rank`, 0 = off) on the gradient reduction; `method` the optimizer (a
    first-order name or a curvature method) with its refresh interval `refresh_steps` (0: not
    packed yet / first-order); `recompute` none, selective or blocks; `stage_blocks` the blocks of
    each of its pieces (`pipeline.stage_blocks`; empty: dealt evenly)."""

    stages: int
    data_parallel: int
    tensor_parallel: int
    schedule: str
    chunks: int
    micro_batches: int
    micro_batch_size: int
    zero: int = 0
    powersgd_rank: int = 0
    method: str = "lamb"
    refresh_steps: int = 0
    recompute: str = "none"
    stage_blocks: tuple[int, ...] = ()

    @property
    def gpus(self) -> int:
        return self.stages * self.data_parallel * self.tensor_parallel

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step."""
        return self.micro_batch_size * self.micro_batches * self.data_parallel

    @property
    def pieces(self) -> int:
        """Model chunks of one pipe: stages x chunks per rank."""
        return self.stages * self.chunks

    def build_schedule(self) -> Schedule:
        """The layout's schedule (ScheduleError where its shape does not fit)."""
        return schedule_of(self.schedule, self.stages, self.micro_batches, self.chunks)

    def describe(self) -> str:
        """Short text: e.g. ``chimera D8 x DP1 x TP1, N8 x mbs32`` (and ``, blocks 4/4/3/1`` on an
        uneven split, `counts_text`)."""
        chunks = f" c{self.chunks}" if self.schedule in CONFIGURABLE_CHUNKS else ""
        split = f", blocks {counts_text(self.stage_blocks)}" if self.stage_blocks else ""
        return (
            f"{self.schedule}{chunks} D{self.stages} x DP{self.data_parallel} x TP{self.tensor_parallel}, "
            f"N{self.micro_batches} x mbs{self.micro_batch_size}{split}"
        )


@lru_cache(maxsize=4096)
def schedule_of(name: str, stages: int, micro_batches: int, chunks: int) -> Schedule:
    """The named schedule (cached: a search asks for the same shapes many times)."""
    return get_schedule(name, stages, micro_batches, chunks if name in CONFIGURABLE_CHUNKS else None)


def buildable(name: str, stages: int, micro_batches: int, chunks: int) -> bool:
    """Whether the schedule exists at this shape (its own constraints: Chimera's even D and N a
    multiple of D, interleaved's N a multiple of D, DualPipeV's N >= 2D, ...)."""
    try:
        schedule_of(name, stages, micro_batches, chunks)
    except ScheduleError:
        return False
    return True


def divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


@dataclass(frozen=True)
class SearchSpace:
    """What a search may vary: the GPUs, the global batch, the micro-batch sizes and
    tensor-parallel degrees the time source can give (None: any the model allows), the
    schedules, recompute modes and PowerSGD ranks to try; `run`: the run file's run section,
    what FSDP2's rules read (precision, compile): ZeRO-2 and 3 are tried where `fsdp_allowed`
    passes (None: not tried)."""

    gpus: int
    global_batch: int
    micro_batch_sizes: tuple[int, ...]
    tensor_parallel: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    powersgd_ranks: tuple[int, ...] = (0,)
    run: RunSettings | None = None


def pipeline_shapes(space: SearchSpace, sizes: ModelSizes) -> Iterator[tuple[int, int, int]]:
    """(stages, data_parallel, tensor_parallel) with their product the GPU count, T dividing
    heads and ffn (T <= 8) and among the source's degrees."""
    degrees = [
        t
        for t in sizes.tensor_parallel_degrees(MAX_TENSOR_PARALLEL)
        if space.tensor_parallel is None or t in space.tensor_parallel
    ]
    for tensor_parallel in degrees:
        if space.gpus % tensor_parallel:
            continue
        for stages in divisors(space.gpus // tensor_parallel):
            if stages <= sizes.blocks:
                yield stages, space.gpus // (tensor_parallel * stages), tensor_parallel


def fsdp_allowed(layout: Layout, method: str, run: RunSettings, tied: bool = False) -> bool:
    """Whether `optimizer.zero` 2 and 3 run `layout` with optimizer `method` (a first-order rule
    or a curvature method, whose declaration's `CurvatureMethod.shards` decides) and run section
    `run`: replicated stages, no refusal of `fsdp_problem` (the rule, tensor parallelism, a split
    backward or a second pipe, precision, compile), and one stage where the model is `tied`
    (`ModelSizes.tied`: the runtime refuses a weight shared by two stages)."""
    if layout.data_parallel < 2 or (tied and layout.pieces > 1):
        return False
    pipeline = PipelineConfig(
        schedule=layout.schedule,
        stages=layout.stages,
        micro_batches=layout.micro_batches,
        chunks=layout.chunks,
        data_parallel=layout.data_parallel,
        tensor_parallel=layout.tensor_parallel,
    )
    return not fsdp_problem(OptimizerConfig(name=method, zero=3), pipeline, run, methods().get(method))


def enumerate_layouts(
    space: SearchSpace,
    sizes: ModelSizes,
    method: str,
    planned: str | None = None,
    balance: Callable[[Layout], tuple[int, ...]] | None = None,
    section: RefreshConfig | None = None,
) -> list[Layout]:
    """Every layout of `space` for `sizes` with optimizer `method` (see the module docstring):
    the model's blocks split evenly over stages x chunks, each schedule buildable at its shape,
    micro_batches = global batch / (micro_batch_size x data_parallel) a whole number. One stage
    runs 1F1B only (the others degenerate to it, or to GPipe's larger activation peak).
    `planned`: the optimizer the search plans for (a curvature method whose first-order rule is
    `method`; None: `method`), what decides whether ZeRO-2 and 3 are tried. `balance`: the blocks
    per piece that balance a layout's pieces (`stage_balance.balanced_split`; empty: the even
    split); where given and the model's kind takes uneven splits, each pipeline is tried on that
    split too (the only one where the pieces do not divide the blocks). `section`: the planned
    curvature method's run-file section, whose `layout_problem` (the run's own check) drops the
    layouts it cannot run and decides whether ZeRO-1, 2 and 3 are tried."""
    found = []
    for stages, data_parallel, tensor_parallel in pipeline_shapes(space, sizes):
        for name in (
            space.schedules
            if stages > 1
            else [name for name in space.schedules if name == "1f1b"] or space.schedules[:1]
        ):
            chunks = chunks_per_rank(name, DEFAULT_CHUNKS if name in CONFIGURABLE_CHUNKS else None)
            pieces = stages * chunks
            even = sizes.blocks % pieces == 0
            uneven = balance is not None and sizes.uneven_splits and 1 < pieces <= sizes.blocks
            if not (even or uneven):
                continue
            for size in space.micro_batch_sizes:
                micro_batches, rest = divmod(space.global_batch, size * data_parallel)
                if rest or micro_batches < 1 or not buildable(name, stages, micro_batches, chunks):
                    continue
                base = Layout(stages, data_parallel, tensor_parallel, name, chunks, micro_batches, size, method=method)
                counts = balance(base) if uneven and balance is not None else ()
                optimizer, replicas = planned or method, stage_replicas(base)
                runs = {  # the ZeRO stages the method's section takes at this layout (the run's check)
                    zero
                    for zero in range(4)
                    if section is None or not section.layout_problem(optimizer, zero, replicas)
                }
                if space.run is None or not fsdp_allowed(base, optimizer, space.run, sizes.tied):
                    runs -= {2, 3}
                for split in ([()] if even else []) + ([counts] if counts else []):
                    layout = replace(base, stage_blocks=split)
                    found += list(_variants(layout, space, data_parallel > 1, runs))
    return found


def stage_replicas(layout: Layout) -> int:
    """Copies of each of `layout`'s stages: its data-parallel replicas, twice over for Chimera's
    two pipes."""
    return (2 if layout.schedule == "chimera" else 1) * layout.data_parallel


def _variants(base: Layout, space: SearchSpace, replicated: bool, zeros: set[int]) -> Iterable[Layout]:
    """`base` with each recompute mode the run allows (`recompute_problem`) and gradient path: plain,
    ZeRO-1, 2 and 3 and PowerSGD where there are data-parallel replicas (ZeRO and PowerSGD exclude
    each other), each where `zeros` holds its ZeRO stage (0: plain and PowerSGD)."""
    paths = [(0, 0)]
    if replicated:
        paths += [(zero, 0) for zero in (1, 2, 3)] + [(0, rank) for rank in space.powersgd_ranks if rank]
    splits = base.build_schedule().splits_backward
    for recompute in space.recompute:
        if recompute_problem(recompute, base.schedule, splits):
            continue
        for zero, powersgd_rank in paths:
            if zero in zeros:
                yield replace(base, zero=zero, powersgd_rank=powersgd_rank, recompute=recompute)


def layout_of_run(
    pipeline, micro_batch_size: int, method: str, zero: int = 0, powersgd_rank: int = 0, recompute: str = "none"
) -> Layout:
    """The layout a run file describes (`pipeline`: its `PipelineConfig`)."""
    return Layout(
        pipeline.stages,
        pipeline.data_parallel,
        pipeline.tensor_parallel,
        pipeline.schedule,
        chunks_per_rank(pipeline.schedule, pipeline.chunks),
        pipeline.micro_batches,
        micro_batch_size,
        zero=int(zero),
        powersgd_rank=powersgd_rank,
        method=method,
        recompute=recompute,
        stage_blocks=pipeline.stage_blocks,
    )


def check_sources_cover(space: SearchSpace, sizes: ModelSizes, layouts: Sequence[Layout]) -> str:
    """Why `layouts` is empty, for the refusal ("" when it is not)."""
    if layouts:
        return ""
    shapes = list(pipeline_shapes(space, sizes))
    if not shapes:
        degrees = space.tensor_parallel or sizes.tensor_parallel_degrees(MAX_TENSOR_PARALLEL)
        return (
            f"--gpus {space.gpus}: no stages x data-parallel x tensor-parallel (T in {', '.join(map(str, degrees))}) "
            f"makes {space.gpus} GPUs for a model of {sizes.blocks} blocks"
        )
    sizes_text = ", ".join(map(str, space.micro_batch_sizes))
    return (
        f"--gpus {space.gpus}: no schedule fits the global batch of {space.global_batch} samples with micro-batch "
        f"sizes {sizes_text} (stages x data-parallel x tensor-parallel: "
        + ", ".join(f"{d}x{r}x{t}" for d, r, t in shapes)
        + "); change data.micro_batch_size or pipeline.micro_batches"
    )
