"""Exposed optimizer time: the step time a curvature method adds over the first-order step of the
same layout, measured side by side on 2 pipeline stages (2 local processes, gloo, one thread each).

Per schedule (`--schedules`, default 1f1b, zb-h1, chimera), per repeat, one `pipefisher run FILE
--json` of the first-order optimizer (`--first-order`, AdamW) and one of each curvature method
(`--methods`, default every method of `pipefisher.methods.registry`) back to back, in an order
shuffled anew each repeat (seeded by `--seed`). Each method runs packed into the bubbles with the
profile its run measures before training, at refresh interval `--refresh-steps` (0: the packer's
choice), re-profiling off (`experiments.exposed.arms`). Its step time: the mean of rank 0's
step times over whole refresh cycles after at least `--warmup` steps (`--cycles` of them); the
first-order run's over the same steps. Per method the ratio method / first-order of each repeat,
their median, and a 95 % t-interval of their geometric mean (on the log ratios,
`experiments.exposed.stats`); exposed = ratio − 1.

Busy and idle per rank: the last repeat's runs go on for one more step and one traced cycle
(`pipefisher run --trace`; those steps are not timed), whose PyTorch profiler traces give each
rank's time in the executor's waits (idle) and the rest (busy), per step (`--no-trace`: none).
Each run's start-up (imports, data, profile) is outside the timed steps but not outside the
benchmark's wall time: about 20-40 s per run here.

Default size: GPT-2 tiny (4 blocks, width 128, seq 64), 4 micro-batches of 32 = 8,192 tokens per
step, 64 tokens per unit of hidden width.

    python experiments/bench_exposed.py --repeats 9 --out /tmp/exposed.md    # the full run
    python experiments/bench_exposed.py --quick                                # a smoke run, ~2 min
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.common import RunFailed, UsageError, listed, progress  # noqa: E402
from experiments.exposed.arms import STAGES, ArmRun, Layout, TraceSpan, cycle_window, mean_ms, run_arm, traced_ranks  # noqa: E402
from experiments.exposed.stats import Pair, Traced, ratio_table, trace_table  # noqa: E402
from experiments.overhead.workloads import WORKLOADS  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402
from pipefisher.methods.registry import methods  # noqa: E402
from pipefisher.core.ir import ScheduleError  # noqa: E402
from pipefisher.schedules import SCHEDULES, get_schedule  # noqa: E402

DEFAULT_SCHEDULES = ("1f1b", "zb-h1", "chimera")
FIRST_ORDER = ("adamw", "lamb", "sgd")
RUN_TIMEOUT_S = 1800.0  # one run, start-up included
QUICK = {"micro_batch_size": 2, "repeats": 2, "refresh_steps": 1, "warmup": 1, "cycles": 2}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedules", help=f"comma-separated (default {','.join(DEFAULT_SCHEDULES)}; --quick: 1f1b)")
    parser.add_argument(
        "--methods", help="comma-separated curvature methods (default: all registered; --quick: the first)"
    )
    parser.add_argument(
        "--model", default=None, help=f"one of {', '.join(WORKLOADS)} (default gpt2-tiny; --quick: bert-tiny)"
    )
    parser.add_argument(
        "--first-order", default="adamw", help=f"the baseline optimizer, one of {', '.join(FIRST_ORDER)}"
    )
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (default 32; --quick 2)")
    parser.add_argument("--refresh-steps", type=int, help="refresh interval k; 0: the packer's choice (default 5)")
    parser.add_argument("--max-refresh-steps", type=int, default=10, help="cap on the packer's k (default 10)")
    parser.add_argument("--warmup", type=int, help="untimed steps at least, rounded up to whole cycles (default 2)")
    parser.add_argument("--cycles", type=int, help="timed refresh cycles per run (default 2)")
    parser.add_argument("--repeats", type=int, help="paired repeats (default 5; --quick 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arms' order per repeat")
    parser.add_argument("--no-trace", action="store_true", help="no traced cycle (no busy/idle table)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: bert-tiny, micro-batches of 2, k=1, 2 repeats"
    )
    parser.add_argument(
        "--out", type=Path, help="write the report here (markdown) and the measurements beside it (.json)"
    )
    args = parser.parse_args(argv)
    defaults = {"micro_batch_size": 32, "repeats": 5, "refresh_steps": 5, "warmup": 2, "cycles": 2}
    for name, value in (QUICK if args.quick else defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for flag in ("micro_batches", "micro_batch_size", "max_refresh_steps", "warmup", "cycles", "repeats"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: {getattr(args, flag)} is not a positive count")
    if args.refresh_steps < 0:
        raise UsageError(f"--refresh-steps: {args.refresh_steps} is negative (0: the packer's choice)")
    known = list(methods())
    args.schedules = listed(
        args.schedules or ("1f1b" if args.quick else ",".join(DEFAULT_SCHEDULES)), SCHEDULES, "--schedules"
    )
    for schedule in args.schedules:
        try:
            get_schedule(schedule, STAGES, args.micro_batches)
        except ScheduleError as exc:
            raise UsageError(f"--schedules {schedule} with --micro-batches {args.micro_batches}: {exc}") from None
    args.methods = listed(args.methods or (known[0] if args.quick else ",".join(known)), known, "--methods")
    args.model = listed(args.model or ("bert-tiny" if args.quick else "gpt2-tiny"), list(WORKLOADS), "--model")
    if len(args.model) != 1:
        raise UsageError("--model: name one model")
    args.model = args.model[0]
    listed(args.first_order, FIRST_ORDER, "--first-order")
    return args


def layout_of(args: argparse.Namespace, schedule: str) -> Layout:
    return Layout(
        WORKLOADS[args.model],
        schedule,
        args.micro_batches,
        args.micro_batch_size,
        args.first_order,
        args.refresh_steps,
        args.max_refresh_steps,
        args.warmup,
        args.cycles,
    )


def measure(args: argparse.Namespace, schedule: str, log: list[dict]) -> tuple[list[Pair], list[Traced]]:
    """Every repeat of one schedule: the pairs (one per method) and the traced last repeat."""
    layout = layout_of(args, schedule)
    arms: list[str | None] = [None, *args.methods]
    labels = {None: args.first_order, **{m: methods()[m].label for m in args.methods}}
    pairs = {m: Pair(schedule, m, labels[m]) for m in args.methods}
    traced: list[Traced] = []
    order = random.Random(f"{args.seed}:{schedule}")
    with tempfile.TemporaryDirectory(prefix="bench_exposed_") as scratch:
        for repeat in range(args.repeats):
            runs: dict[str | None, ArmRun] = {}
            last = repeat == args.repeats - 1 and not args.no_trace
            # one traced cycle after an untimed gap step (the profiler's own warm-up); with the
            # packer's k: the largest k a method got in the previous repeat
            k = args.refresh_steps or max((p.refresh_steps[-1] for p in pairs.values() if p.refresh_steps), default=1)
            for arm in order.sample(arms, len(arms)):
                trace = TraceSpan(Path(scratch) / labels[arm], layout.steps + 2, k) if last else None
                steps = layout.steps + (1 + k if trace else 0)
                runs[arm] = run_arm(layout, arm, steps, trace, RUN_TIMEOUT_S)
                log.append({"schedule": schedule, "repeat": repeat, "arm": labels[arm], **vars(runs[arm])})
                if trace:
                    traced.append(Traced(schedule, labels[arm], k, traced_ranks(trace.folder)))
                progress(
                    f"{schedule} repeat {repeat + 1}/{args.repeats} {labels[arm]}: median step "
                    f"{statistics.median(runs[arm].step_ms):.1f} ms, {runs[arm].seconds:.0f} s, "
                    f"other processes {runs[arm].other_cores:.2f} cores"
                )
            for method, pair in pairs.items():
                k = runs[method].refresh_steps or 1
                window = cycle_window(k, layout.warmup, layout.steps)
                pair.first_order_ms.append(mean_ms(runs[None], window))
                pair.method_ms.append(mean_ms(runs[method], window))
                pair.refresh_steps.append(k)
                progress(f"{schedule} repeat {repeat + 1}/{args.repeats} {pair.label}: ratio {pair.ratios[-1]:.3f}")
    order_traced = {labels[a]: i for i, a in enumerate(arms)}
    return list(pairs.values()), sorted(traced, key=lambda t: order_traced[t.label])


def report(args: argparse.Namespace, pairs: list[Pair], traced: list[Traced], log: list[dict], seconds: float) -> str:
    tokens = ", ".join(f"{t:,}" for t in sorted({entry["tokens_per_step"] for entry in log}))
    others = [entry["other_cores"] for entry in log]
    lines = [
        "# Exposed optimizer time: curvature methods against the first-order step",
        "",
        f"Command: `python {shlex.join(['experiments/bench_exposed.py', *sys.argv[1:]])}`",
        "",
        f"Machine: CPU, {os.cpu_count()} cores, 2 ranks of one thread each (gloo); other processes used a median "
        f"{statistics.median(others):.2f} cores (at most {max(others):.2f}) during the runs; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) at the end; {seconds / 60:.0f} min in all.",
        "",
        f"Model {WORKLOADS[args.model].label or args.model}, 2 stages, {args.micro_batches} micro-batches of "
        f"{args.micro_batch_size} = {tokens} tokens per step; baseline {args.first_order}; "
        f"methods packed, k {'chosen by the packer' if not args.refresh_steps else args.refresh_steps}, re-profiling off; "
        f"paired repeats: {args.repeats} (arms in a seeded shuffled order per repeat); timed per run: "
        f"{args.cycles} whole refresh cycle(s) after at least {args.warmup} warm-up step(s).",
        "Ratio: method / first-order step time of the same repeat; CI: 95 % t-interval of the geometric mean "
        "(log ratios); exposed: ratio − 1.",
        "",
        ratio_table(pairs),
    ]
    if traced:
        lines += [
            "",
            "Per rank, one traced cycle of the last repeat's runs (PyTorch profiler on: slower than the timed steps): "
            "idle = time in the executor's waits (messages, collectives), busy = the rest of the step.",
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
    log: list[dict] = []
    pairs: list[Pair] = []
    traced: list[Traced] = []
    try:
        for schedule in args.schedules:
            found = measure(args, schedule, log)
            pairs += found[0]
            traced += found[1]
    except RunFailed as exc:
        print(f"bench_exposed: {exc}", file=sys.stderr)
        return 1
    text = report(args, pairs, traced, log, time.perf_counter() - started)
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        measurements = {
            "command": sys.argv,
            "pairs": [p.as_dict() for p in pairs],
            "traced": [{**vars(t), "ranks": [vars(r) for r in t.ranks]} for t in traced],
            "runs": log,
        }
        args.out.with_suffix(".json").write_text(json.dumps(measurements, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "bench_exposed"))
