"""`pipefisher plan RUN.yaml --gpus N --memory-gb M` (or `--hardware h100x8`): the fastest layout
of the run's model on N GPUs of M GiB each, less a memory reserve, with its curvature method's
refresh interval, predicted (`pipefisher.planning.planner.search`); the ranked table, where the
run file's own layout ranks, and the best written as a run file. Pure Python: no torch."""

from __future__ import annotations

import argparse
import json
from concurrent.futures.process import BrokenProcessPool
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from pipefisher.cli.args import UsageError, check_output, non_negative_float, positive_float, positive_int, say
from pipefisher.config import FIRST_ORDER, RunConfig, load_config
from pipefisher.core.files import parse_yaml
from pipefisher.core.profile import load_profile
from pipefisher.methods.registry import DEFAULT_METHOD, methods
from pipefisher.planning.planner.candidates import RECOMPUTE_MODES, Layout, SearchSpace, layout_of_run
from pipefisher.planning.planner.flop_times import DEFAULT_MICRO_BATCH_SIZES, FlopTimes
from pipefisher.planning.planner.hardware import PRESET_FOLDER, Hardware, hardware_of, load_hardware
from pipefisher.planning.planner.layout_memory import RESERVE_FIXED_GIB, RESERVE_SHARE, default_reserve_gib
from pipefisher.planning.planner.model_sizes import ModelSizes, PlanError, model_sizes
from pipefisher.planning.planner.predict import (
    DEFAULT_DP_BANDWIDTH_GBPS,
    PlanContext,
    Prediction,
    TimeSource,
    is_curvature,
    source_bandwidth_gbps,
)
from pipefisher.planning.planner.search import DEFAULT_PACKED, GiB, SearchResult, search
from pipefisher.planning.planner.search_pool import usable_cpus
from pipefisher.planning.planner.sources import MeasuredTimes, ReferenceTimes
from pipefisher.planning.planner.table import prediction_dict, ranked_table, run_file_of

REFERENCE_FOLDER = Path(__file__).resolve().parents[2] / "profiles" / "reference"
#: the sequence length the reference CSVs were measured at
REFERENCE_SEQ_LEN = 128


def add_plan_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="the fastest layout of a run's model on N GPUs within a memory budget, predicted",
        description="Enumerates stages x data-parallel x tensor-parallel layouts, schedules, micro-batch "
        "sizes (the global batch fixed), ZeRO-1, ZeRO-2/3 (where FSDP2 runs the layout) and recomputation; simulates each, packs the "
        "curvature method for the fastest that fit, and ranks them.",
    )
    parser.add_argument("config", help="YAML run file: model, global batch, optimizer and method settings")
    parser.add_argument("--gpus", type=positive_int, required=True, help="GPUs to lay the run out on")
    parser.add_argument(
        "--hardware",
        metavar="NAME[xG]|FILE",
        help="the GPUs and their links: a preset (a100-40gb, a100-80gb, h100, h200, p100, v100; xG: G GPUs per "
        "node, e.g. h100x8) or a hardware YAML file; sets --memory-gb and costs each collective on the link it "
        "crosses (docs/planner.md)",
    )
    parser.add_argument(
        "--memory-gb",
        type=positive_float,
        help="memory per GPU, GiB (2^30 bytes); required without --hardware, else the hardware's",
    )
    parser.add_argument(
        "--reserve-gb",
        type=non_negative_float,
        help="memory per GPU held back for the CUDA context, NCCL's buffers and allocator slack, GiB "
        f"(default {RESERVE_FIXED_GIB:g} + {100 * RESERVE_SHARE:g} %% of --memory-gb); no layout needing more than "
        "the rest is ranked",
    )
    parser.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="FILE",
        help="a measured profile of this run's model (pipefisher.profile/v2; repeat for other splits, "
        "micro-batch sizes or degrees)",
    )
    parser.add_argument(
        "--reference-csv",
        metavar="CSV",
        help="per-block times (profiles/reference/*.csv); default for bert-base/bert-large: the paper's P100 times",
    )
    parser.add_argument(
        "--times",
        choices=("auto", "flops"),
        default="auto",
        help="where per-stage times come from: auto (default) = the --profile given, else the reference CSV of "
        "a model it times (bert-base, bert-large) without --hardware or on p100, else flops on --hardware; "
        "flops = model FLOPs at calibrated shares of the hardware's peak (needs --hardware; docs/planner.md)",
    )
    parser.add_argument(
        "--method",
        choices=[*FIRST_ORDER, *methods()],
        help="optimizer to plan for (default: optimizer.name if a curvature method, else the curvature "
        "section the run file writes, else optimizer.name)",
    )
    parser.add_argument(
        "--max-tensor-parallel",
        type=positive_int,
        default=8,
        metavar="T",
        help="largest tensor-parallel degree tried (default 8; 1: pipeline and data parallelism only)",
    )
    parser.add_argument(
        "--even-splits",
        action="store_true",
        help="split the blocks evenly over the stages only (default: also try, for model kinds that take "
        "pipeline.stage_blocks, the split that balances the stages' compute, the head included)",
    )
    parser.add_argument("--top", type=positive_int, default=10, help="rows of the table (default 10)")
    parser.add_argument(
        "--packed",
        type=positive_int,
        default=DEFAULT_PACKED,
        help=f"most layouts packed, the fastest first-order ones that fit (default {DEFAULT_PACKED})",
    )
    parser.add_argument(
        "--dp-bandwidth-gbps",
        type=positive_float,
        default=None,
        help="data-parallel all-reduce bandwidth, GB/s (default: the links --hardware gives, else what a "
        f"--profile's p2p times show, else {DEFAULT_DP_BANDWIDTH_GBPS:g})",
    )
    parser.add_argument(
        "--jobs",
        "-j",
        type=positive_int,
        default=None,
        help="processes that share the search (default: the CPUs this process may use; the ranking is the same for any number)",
    )
    parser.add_argument("-o", "--output", help="write the best layout as a run file (YAML) here")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.set_defaults(handler=_cmd_plan)


def _raw_run_file(path: str) -> dict:
    data = parse_yaml(Path(path).read_text()) or {}
    return {section: values or {} for section, values in data.items()}


def planned_method(config: RunConfig, raw: dict, chosen: str | None) -> str:
    """`chosen`, or optimizer.name if it is a curvature method, or the first curvature section
    the run file writes, or optimizer.name."""
    if chosen:
        return chosen
    if is_curvature(config.optimizer.name):
        return config.optimizer.name
    return next((name for name in raw if name in methods()), config.optimizer.name)


def memory_budget(args: argparse.Namespace, hardware: Hardware | None) -> tuple[float, float]:
    """(memory per GPU, reserve) in GiB: --memory-gb or the hardware's, --reserve-gb or
    `default_reserve_gib`; UsageError where neither memory is given or the reserve leaves none."""
    memory = args.memory_gb or (hardware.memory_gib if hardware else None)
    if memory is None:
        raise UsageError("plan: give --memory-gb (GiB per GPU) or --hardware (e.g. h100x8)")
    reserve = default_reserve_gib(memory) if args.reserve_gb is None else args.reserve_gb
    if reserve >= memory:
        raise UsageError(f"--reserve-gb {reserve:g} leaves nothing of {memory:g} GiB per GPU; give a smaller one")
    return memory, reserve


def time_source(
    args: argparse.Namespace,
    sizes: ModelSizes,
    method: str,
    hardware: Hardware | None = None,
    config: RunConfig | None = None,
) -> TimeSource:
    """The measured profiles; or the reference CSV given, or the model's where there is one and the
    hardware is none or the P100; or `FlopTimes` on the hardware (`--times flops` always)."""
    curvature = method if is_curvature(method) else None
    if args.times == "flops":
        if args.profile or args.reference_csv:
            raise UsageError("--times flops: give it without --profile and --reference-csv (they give the times)")
        return _flop_times(sizes, method, hardware, config)
    if args.profile:
        if args.reference_csv:
            raise UsageError("give --profile (measured) or --reference-csv (per-block times), not both")
        return MeasuredTimes.check([(path, load_profile(path)) for path in args.profile], sizes, curvature)
    path = Path(args.reference_csv) if args.reference_csv else REFERENCE_FOLDER / f"{sizes.name}_time_memory_p100.csv"
    on_p100 = hardware is None or hardware.name == load_hardware(PRESET_FOLDER / "p100.yaml").name
    if not args.reference_csv and hardware is not None and (not on_p100 or not path.is_file()):
        return _flop_times(sizes, method, hardware, config)
    if not path.is_file():
        raise PlanError(
            f"{sizes.name}: no times to plan with; give --profile FILE (`pipefisher profile`), --reference-csv CSV "
            "or --hardware (times from flops)"
        )
    if curvature and curvature != DEFAULT_METHOD:
        raise PlanError(
            f"{path.name} times {DEFAULT_METHOD}'s tasks, not {curvature}'s; give --profile of a "
            f"`pipefisher profile --optimizer {curvature}` run"
        )
    if sizes.seq_len != REFERENCE_SEQ_LEN:
        say(
            f"warning: {path.name} was measured at {REFERENCE_SEQ_LEN} tokens per sequence, the run has {sizes.seq_len}"
        )
    return ReferenceTimes.open(path, sizes)


def _flop_times(sizes: ModelSizes, method: str, hardware: Hardware | None, config: RunConfig | None) -> FlopTimes:
    """Times from flops on `hardware` for the run `config` (UsageError without hardware)."""
    if hardware is None or config is None:
        raise UsageError("--times flops: give --hardware (e.g. a100-80gb or h100x8): the flops need its peak")
    section = config.section(method) if is_curvature(method) else None
    sizes_tried = (*DEFAULT_MICRO_BATCH_SIZES, config.data.micro_batch_size)
    return FlopTimes.check(sizes, hardware, config.run.precision, method, section, sizes_tried, config.run.tf32)


def _own_line(own: Layout, result: SearchResult, prediction: Prediction | None, budget: int) -> str:
    """Where the run file's own layout ranks, beside the best."""
    best = result.best
    if prediction is None:
        return f"the run file's layout ({own.describe()}) is not one of these GPUs' layouts"
    place = result.rank_of(prediction.layout)
    where = (
        f"ranks #{place} of {len(result.ranked)} packed"
        if place
        else (
            "does not fit the budget"
            if prediction.memory.total > budget
            else "is not among the packed (slower first-order step)"
        )
    )
    return (
        f"the run file's layout {own.describe()} with {own.method} (k={prediction.layout.refresh_steps}): "
        f"{prediction.step_ms:.1f} ms per step (first-order {prediction.first_order_ms:.1f} ms, bubble "
        f"{100 * prediction.bubble_share:.0f} %), {prediction.memory.total / GiB:.2f} GiB; {where}; the best ({best.layout.describe()}) "
        f"{best.step_ms:.1f} ms, {100 * (prediction.step_ms / best.step_ms - 1):+.1f} % for the run file's"
    )


def _exposed_line(ranked: Sequence[Prediction]) -> str:
    """Each row's predicted exposed optimizer time: the mean step over its refresh cycle with all
    of the method's work over the first-order step of the same layout, minus 1 (JSON
    `exposed_share`)."""
    shares = ", ".join(f"#{place} {100 * p.overhead_share:.2f}" for place, p in enumerate(ranked, 1))
    return f"exposed optimizer time [%] (step over the same layout's first-order step, - 1): {shares}"


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.output:
        check_output(args.output, "-o")
    hardware = hardware_of(args.hardware) if args.hardware else None
    memory_gib, reserve_gib = memory_budget(args, hardware)
    config, raw = load_config(args.config), _raw_run_file(args.config)
    sizes = model_sizes(config)
    method = planned_method(config, raw, args.method)
    first_order = config.section(method).first_order if is_curvature(method) else method
    source = time_source(args, sizes, method, hardware, config)
    if hardware is not None and isinstance(source, ReferenceTimes):
        source = replace(source, hardware=hardware)
    pipeline = config.pipeline
    global_batch = config.data.micro_batch_size * pipeline.micro_batches * pipeline.data_parallel
    degrees = tuple(
        t for t in source.tensor_parallel or range(1, args.max_tensor_parallel + 1) if t <= args.max_tensor_parallel
    )
    space = SearchSpace(
        args.gpus,
        global_batch,
        source.micro_batch_sizes,
        degrees,
        recompute=RECOMPUTE_MODES,
        powersgd_ranks=(config.comm.powersgd_rank,),
        run=config.run,
    )
    context = PlanContext(
        sizes,
        source,
        first_order,
        config.section(method) if is_curvature(method) else None,
        replace(config, optimizer=replace(config.optimizer, name=method)).optimizer_settings.momentum,
        config.run.precision,
        args.dp_bandwidth_gbps or source_bandwidth_gbps(source, sizes, config.run.precision),
        hardware=hardware,
        dp_bandwidth_set=args.dp_bandwidth_gbps is not None,
    )
    budget = int((memory_gib - reserve_gib) * GiB)
    own = layout_of_run(
        pipeline, config.data.micro_batch_size, method, config.optimizer.zero, config.comm.powersgd_rank
    )
    own_layouts = (own,) if own.gpus == args.gpus and _plannable(own, sizes, source) else ()
    try:
        result = search(
            space,
            context,
            method,
            budget,
            args.packed,
            args.top,
            not args.json,
            args.jobs or usable_cpus(),
            own_layouts,
            uneven=not args.even_splits,
        )
    except BrokenProcessPool:
        say(
            f"error: a worker of the search died (out of memory?); --jobs {args.jobs or usable_cpus()} processes shared it, fewer use less memory"
        )
        return 1
    except PlanError as exc:
        if not str(exc).startswith("--memory-gb"):  # search names the budget it was given: say what it is
            raise
        raise PlanError(
            f"{exc}; {budget / GiB:.2f} GiB = {memory_gib:g} GiB per GPU less the reserve of {reserve_gib:.2f} GiB "
            "(--reserve-gb sets it)"
        ) from None
    own_prediction = result.predictions[own_layouts[0]] if own_layouts else None
    if args.output:
        Path(args.output).write_text(run_file_of(raw, result.best.layout))
    if args.json:
        print(
            json.dumps(
                {
                    "gpus": args.gpus,
                    "memory_bytes": int(memory_gib * GiB),
                    "reserve_bytes": int(reserve_gib * GiB),
                    "budget_bytes": budget,
                    "hardware": asdict(hardware) if hardware else None,
                    "global_batch": global_batch,
                    "method": method,
                    "enumerated": result.enumerated,
                    "over_budget": result.over_budget,
                    "dominated": result.dominated,
                    "packed": result.packed,
                    "over_after_packing": result.over_after_packing,
                    "seconds": result.seconds,
                    "ranked": [prediction_dict(p) for p in result.ranked[: args.top]],
                    "first_order_best": prediction_dict(result.first_order[0]) if result.first_order else None,
                    "run_file_layout": prediction_dict(own_prediction) if own_prediction else None,
                }
            )
        )
        return 0
    print(
        f"{sizes.name} on {args.gpus} GPUs of {memory_gib:g} GiB, global batch {global_batch} x {sizes.seq_len} tokens, "
        f"{method} (first-order: {first_order}); times from {_source_name(source)}"
    )
    print(
        f"{result.enumerated} layouts enumerated, {result.over_budget} over the memory budget, {result.dominated} dominated "
        f"(recompute or gradient-path variants), {result.packed} packed ({result.over_after_packing} over the budget with "
        f"captures); {result.seconds:.1f} s"
    )
    print(
        f"memory per GPU: {memory_gib:g} GiB less a reserve of {reserve_gib:.2f} GiB (CUDA context, NCCL buffers, "
        f"allocator slack; --reserve-gb) = {budget / GiB:.2f} GiB for the layout; 'free' below is what is left of that"
    )
    print(
        f"hardware: {hardware.describe()}"
        if hardware
        else f"links: every data-parallel collective at {context.dp_bandwidth_gbps:g} GB/s, no latency (--hardware costs each on its link)"
    )
    print(ranked_table(result.ranked, budget, args.top))
    if is_curvature(method):
        print(_exposed_line(result.ranked[: args.top]))
    if is_curvature(method) and result.first_order:
        fastest = result.first_order[0]
        print(f"first-order ({first_order}) fastest: {fastest.layout.describe()}, {fastest.step_ms:.1f} ms per step")
    print(_own_line(own, result, own_prediction, budget))
    if own_prediction is not None and is_curvature(method):
        print(f"the run file's layout: exposed optimizer time {100 * own_prediction.overhead_share:.2f} %")
    if args.output:
        print(f"best layout written to {args.output}")
    return 0


def _plannable(layout: Layout, sizes: ModelSizes, source) -> bool:
    """Whether the source can time the run file's own layout (its micro-batch size and degree)."""
    degrees = source.tensor_parallel
    return (
        layout.micro_batch_size in source.micro_batch_sizes
        and (degrees is None or layout.tensor_parallel in degrees)
        and (bool(layout.stage_blocks) or sizes.blocks % layout.pieces == 0)
    )


def _source_name(source) -> str:
    if isinstance(source, ReferenceTimes):
        return f"{source.path.name} (per-block P100 times, modelled per stage)"
    if isinstance(source, FlopTimes):
        return source.describe()
    return ", ".join(path for path, _ in source.profiles)
