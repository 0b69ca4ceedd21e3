"""Exposed optimizer time: the step time a curvature method adds over the first-order step of the
same layout, measured side by side on 2 pipeline stages inside one process group.

Per schedule (`--schedules`, default 1f1b, zb-h1, chimera), one group of 2 local processes (gloo
on 127.0.0.1, one thread each) builds one trainer per arm: the first-order optimizer
(`--first-order`, AdamW) and each curvature method (`--methods`, default every method of
`pipefisher.methods.registry`), from the same run file, seed and data. Each method runs packed
into the bubbles with a profile it measures once, at refresh interval `--refresh-steps` (0: the
packer's choice), re-profiling off (`experiments.exposed.arms`). Every arm is warmed up (at
least `--warmup` steps and 2 cycles), then `--repeats` rounds: in each, every arm runs one timed
block of whole refresh cycles (at least `--min-steps` steps) in an order shuffled anew each
round (seeded by `--seed`), a barrier before each block; a block's sample is the slower rank's
wall time / its steps (`experiments.exposed.group`). Per method the ratio method / first-order
of each round, their median and a 95 % t-interval of their geometric mean (on the log ratios,
`experiments.exposed.stats`); exposed = ratio − 1. The same over the quiet rounds: other
processes used at most `--quiet-load` cores during both blocks (from /proc/stat). Arms
alternated within one group share the machine's state of the moment, which separate runs
minutes apart do not (they varied by ±8 % here).

`--groups G` measures each schedule G times, one process group after the other, each with fresh
processes, arms and profiles: the ratios of one group share what stays fixed for its life (where
each arm's tensors lie, the machine's state of that hour), which its rounds' interval cannot
show (two runs of 13 rounds an hour apart differed by twice their intervals' half-widths), so with
G ≥ 2 the interval is Student's t over the G groups' mean log ratios.

Ops, end of step and waits per rank: after the rounds every arm runs one more block with the
executor's clock marks around every op (`--no-trace`: none).

Default size: GPT-2 tiny (4 blocks, width 128, seq 64), 4 micro-batches of 32 = 8,192 tokens per
step, 64 tokens per unit of hidden width.

    python experiments/bench_exposed.py --repeats 15 --out /tmp/exposed.md    # the full run
    python experiments/bench_exposed.py --quick                                 # a smoke run, < 1 min
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.common import UsageError, listed, progress  # noqa: E402
from experiments.exposed.arms import HELPED, STAGES, Layout, method_name  # noqa: E402
from experiments.exposed.group import RankResult, Timing, cycles_of, measure_schedule  # noqa: E402
from experiments.exposed.stats import Pair, Traced, ratio_table, trace_table  # noqa: E402
from experiments.overhead.workloads import WORKLOADS  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402
from pipefisher.core.ir import ScheduleError  # noqa: E402
from pipefisher.core.settings import ConfigError  # noqa: E402
from pipefisher.methods.registry import methods  # noqa: E402
from pipefisher.runtime.training import GroupFailure, run_group  # noqa: E402
from pipefisher.schedules import SCHEDULES, get_schedule  # noqa: E402

DEFAULT_SCHEDULES = ("1f1b", "zb-h1", "chimera")
FIRST_ORDER = ("adamw", "lamb", "sgd")
#: bound of any wait inside a group [s]
GROUP_TIMEOUT_S = 300.0
QUICK = {"micro_batch_size": 2, "repeats": 2, "refresh_steps": 1, "warmup": 1, "min_steps": 2}
DEFAULTS = {"micro_batch_size": 32, "repeats": 9, "refresh_steps": 5, "warmup": 2, "min_steps": 5}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedules", help=f"comma-separated (default {','.join(DEFAULT_SCHEDULES)}; --quick: 1f1b)")
    parser.add_argument(
        "--methods",
        help="comma-separated curvature methods (default: all registered; --quick: the first); NAME+helpers: "
        "with the section's helpers on (the methods whose rules allow them)",
    )
    parser.add_argument(
        "--model", default=None, help=f"one of {', '.join(WORKLOADS)} (default gpt2-tiny; --quick: bert-tiny)"
    )
    parser.add_argument(
        "--first-order", default="adamw", help=f"the baseline optimizer, one of {', '.join(FIRST_ORDER)}"
    )
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (default 32; --quick 2)")
    parser.add_argument(
        "--stage-blocks",
        default="",
        help="blocks of each stage, comma-separated (pipeline.stage_blocks, e.g. 3,1; default: even)",
    )
    parser.add_argument("--refresh-steps", type=int, help="refresh interval k; 0: the packer's choice (default 5)")
    parser.add_argument("--max-refresh-steps", type=int, default=10, help="cap on the packer's k (default 10)")
    parser.add_argument(
        "--warmup", type=int, help="untimed steps per arm at least, rounded up to whole cycles, 2 at least (default 2)"
    )
    parser.add_argument(
        "--min-steps", type=int, help="timed steps per block at least, rounded up to whole cycles (default 5)"
    )
    parser.add_argument("--repeats", type=int, help="rounds: timed blocks per arm (default 9; --quick 2)")
    parser.add_argument(
        "--groups",
        type=int,
        default=1,
        help="process groups per schedule, one after the other, each with fresh processes, arms, profiles and "
        "--repeats rounds; with 2 or more the intervals are over the groups' means (default 1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the arms' order per round")
    parser.add_argument(
        "--quiet-load",
        type=float,
        default=0.15,
        help="a round is quiet for a pair when other processes used at most this many cores (default 0.15)",
    )
    parser.add_argument(
        "--deadline", type=float, default=1800.0, help="seconds per group before it is stopped (default 1800)"
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="interleave the arms' blocks step by step, a barrier before each step (default: one block per arm in turn)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a setting of a method's section on its arms, e.g. soap.statistics_dtype=float32 (repeatable)",
    )
    parser.add_argument("--no-trace", action="store_true", help="no recorded block (no ops / waits table)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: bert-tiny, micro-batches of 2, k=1, 2 rounds of 2 steps"
    )
    parser.add_argument(
        "--out", type=Path, help="write the report here (markdown) and the measurements beside it (.json)"
    )
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for flag in ("micro_batches", "micro_batch_size", "max_refresh_steps", "warmup", "min_steps", "repeats", "groups"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: {getattr(args, flag)} is not a positive count")
    if args.refresh_steps < 0:
        raise UsageError(f"--refresh-steps: {args.refresh_steps} is negative (0: the packer's choice)")
    if args.quiet_load < 0 or args.deadline <= 0:
        raise UsageError("--quiet-load must be >= 0 cores and --deadline > 0 s")
    known = [*methods(), *(f"{name}{HELPED}" for name, method in methods().items() if method.rules.helpers)]
    args.schedules = listed(
        args.schedules or ("1f1b" if args.quick else ",".join(DEFAULT_SCHEDULES)), SCHEDULES, "--schedules"
    )
    for schedule in args.schedules:
        try:
            get_schedule(schedule, STAGES, args.micro_batches)
        except ScheduleError as exc:
            raise UsageError(f"--schedules {schedule} with --micro-batches {args.micro_batches}: {exc}") from None
    args.methods = listed(args.methods or (known[0] if args.quick else ",".join(methods())), known, "--methods")
    helped = [method for method in args.methods if method.endswith(HELPED)]
    several = [
        schedule for schedule in args.schedules if get_schedule(schedule, STAGES, args.micro_batches).num_pipes > 1
    ]
    if helped and several:
        raise UsageError(
            f"--methods {helped[0]}: not with --schedules {several[0]} (help ops pair the ranks of one pipeline)"
        )
    args.model = listed(args.model or ("bert-tiny" if args.quick else "gpt2-tiny"), list(WORKLOADS), "--model")
    if len(args.model) != 1:
        raise UsageError("--model: name one model")
    args.model = args.model[0]
    listed(args.first_order, FIRST_ORDER, "--first-order")
    try:
        args.stage_blocks = tuple(int(count) for count in args.stage_blocks.split(",") if count.strip())
    except ValueError:
        raise UsageError(
            f"--stage-blocks: {args.stage_blocks!r} is not block counts, comma-separated (e.g. 3,1)"
        ) from None
    args.settings = settings_of(args.set, {method_name(method) for method in args.methods})
    for method in args.methods:
        try:
            layout_of(args, args.schedules[0]).config(method)
        except ConfigError as exc:
            raise UsageError(f"--set: {exc}") from None
    return args


def settings_of(assignments: list[str], sections: set[str]) -> tuple[tuple[str, str, object], ...]:
    """Each ``SECTION.KEY=VALUE`` of `assignments` as (section, key, value), the value read as
    YAML; UsageError where one is malformed or names a section of no method among `sections`."""
    found = []
    for text in assignments:
        name, _, value = text.partition("=")
        section, _, key = name.partition(".")
        if not (section and key and value):
            raise UsageError(f"--set {text!r}: give SECTION.KEY=VALUE, e.g. soap.statistics_dtype=float32")
        if section not in sections:
            raise UsageError(f"--set {text!r}: {section!r} is not the section of a method of --methods")
        found.append((section, key, yaml.safe_load(value)))
    return tuple(found)


def layout_of(args: argparse.Namespace, schedule: str) -> Layout:
    return Layout(
        WORKLOADS[args.model],
        schedule,
        args.micro_batches,
        args.micro_batch_size,
        args.first_order,
        args.refresh_steps,
        args.max_refresh_steps,
        GROUP_TIMEOUT_S,
        args.stage_blocks,
        args.settings,
    )


def measure(args: argparse.Namespace, schedule: str) -> tuple[list[Pair], list[Traced], list[RankResult]]:
    """One schedule's `--groups` process groups, one after the other: a pair per method over all
    their rounds, the first group's recorded block per arm and its rank results."""
    per_group = [measure_group(args, schedule, group) for group in range(args.groups)]
    pairs = [Pair.merged(list(found)) for found in zip(*(pairs for pairs, _, _ in per_group))]
    _, traced, results = per_group[0]
    return pairs, traced, results


def measure_group(
    args: argparse.Namespace, schedule: str, group: int
) -> tuple[list[Pair], list[Traced], list[RankResult]]:
    """Process group number `group` of a schedule: a pair per method and, in the first group,
    the recorded block per arm."""
    if args.groups > 1:
        progress(f"{schedule}: process group {group + 1} of {args.groups}")
    timing = Timing(
        args.repeats, args.min_steps, args.warmup, args.seed, not args.no_trace and group == 0, args.interleave, group
    )
    results = run_group(
        measure_schedule,
        STAGES,
        args=(layout_of(args, schedule), args.methods, timing),
        backend="gloo",
        timeout=GROUP_TIMEOUT_S,
        deadline=args.deadline,
    )
    results = sorted(results, key=lambda r: r.rank)
    first, fo = results[0], args.first_order
    pairs = [
        Pair(
            schedule,
            m,
            label_of(m, fo),
            first.k[m],
            args.quiet_load,
            first.step_ms[fo],
            first.step_ms[m],
            first.other_cores[fo],
            first.other_cores[m],
            first.own_estimate.get(m),
        )
        for m in args.methods
    ]
    blocks = {name: cycles_of(k, args.min_steps) * k for name, k in first.k.items()}
    traced = [
        Traced(schedule, label_of(name, fo), blocks[name], tuple(r.cycle[name] for r in results))
        for name in (fo, *args.methods)
        if first.cycle
    ]
    return pairs, traced, results


def label_of(name: str, first_order: str) -> str:
    """The first-order optimizer's name, a method's label, with " + helpers" for its `HELPED` arm."""
    if name == first_order:
        return name
    return methods()[method_name(name)].label + (" + helpers" if name.endswith(HELPED) else "")


def report(
    args: argparse.Namespace,
    pairs: list[Pair],
    traced: list[Traced],
    groups: dict[str, list[RankResult]],
    seconds: float,
) -> str:
    firsts = [results[0] for results in groups.values()]
    tokens = ", ".join(f"{t:,}" for t in sorted({r.tokens_per_step for r in firsts}))
    others = [load for r in firsts for loads in r.other_cores.values() for load in loads]
    builds = ", ".join(f"{r.build_seconds:.0f}" for r in firsts)
    lines = [
        "# Exposed optimizer time: curvature methods against the first-order step",
        "",
        f"Command: `python {shlex.join(['experiments/bench_exposed.py', *sys.argv[1:]])}`",
        "",
        f"Machine: CPU, {os.cpu_count()} cores, 2 ranks of one thread each (gloo), "
        f"{'one process group' if args.groups == 1 else f'{args.groups} process groups, one after the other,'} per schedule; other "
        f"processes used a median {statistics.median(others):.2f} cores (at most {max(others):.2f}) during the timed "
        f"blocks; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) at the end; "
        f"{seconds / 60:.1f} min in all (building the arms, profiles included: {builds} s per schedule).",
        "",
        f"Model {WORKLOADS[args.model].label or args.model}, 2 stages"
        f"{f' of {list(args.stage_blocks)} blocks' if args.stage_blocks else ''}, {args.micro_batches} micro-batches of "
        f"{args.micro_batch_size} = {tokens} tokens per step; baseline {args.first_order}; "
        f"methods packed, k {'chosen by the packer' if not args.refresh_steps else args.refresh_steps}, profile "
        f"measured once, re-profiling off; every arm in the same process group: {args.repeats} rounds "
        f"{'' if args.groups == 1 else 'per group (profiles and arms built anew in each; intervals over the groups) '}of one timed "
        f"block per arm (whole refresh cycles, at least {args.min_steps} steps; arms in a seeded shuffled order per "
        f"round, {'interleaved step by step, a barrier before each step' if args.interleave else 'a barrier before each block'}) after at least {args.warmup} warm-up step(s) and 2 cycles.",
        "Step time: the slower rank's block wall time / its steps. Ratio: method / first-order of the same round; "
        f"CI: 95 % t-interval of the geometric mean (log ratios{'' if args.groups == 1 else ', over the groups: one mean per group'}); exposed: ratio − 1. Quiet rounds: other processes "
        f"used at most {args.quiet_load:.2f} cores during both blocks of the pair. The run's own estimate: "
        "`pipefisher run`'s exposed_share (its op times of one cycle, simulated with and without the method).",
        "",
        ratio_table(pairs),
    ]
    if traced:
        lines += [
            "",
            "Per rank, one more block per arm after the rounds, recorded (the executor's clock marks around every op), "
            "ms per step: "
            "ops = forward, backward and the method's tasks, of them compute = forwards, backwards and weight "
            "gradients (against the first-order arm's: on a CPU the method's tasks on one core can slow the other "
            "core's compute); end of step = after the last op (optimizer step, "
            "gradient and loss reductions, the next step's batches); waits = the rest (the other stage's messages, "
            "collectives).",
            "",
            trace_table(traced),
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    try:
        args = parse()
    except UsageError as exc:
        print(f"bench_exposed: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    pairs: list[Pair] = []
    traced: list[Traced] = []
    groups: dict[str, list[RankResult]] = {}
    try:
        for schedule in args.schedules:
            found = measure(args, schedule)
            pairs += found[0]
            traced += found[1]
            groups[schedule] = found[2]
    except GroupFailure as exc:
        print(f"bench_exposed: {(str(exc).splitlines() or ['a rank failed'])[0]}", file=sys.stderr)
        return 1
    text = report(args, pairs, traced, groups, time.perf_counter() - started)
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        measurements = {
            "command": sys.argv,
            "pairs": [p.as_dict() for p in pairs],
            "traced": [t.as_dict() for t in traced],
            "groups": {schedule: [asdict(r) for r in results] for schedule, results in groups.items()},
        }
        args.out.with_suffix(".json").write_text(json.dumps(measurements, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "bench_exposed"))
