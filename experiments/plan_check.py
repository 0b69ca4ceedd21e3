"""The layout planner's step-time predictions against real `pipefisher run`s on this machine.

In each round, for each shipped CPU model (schedules/tiny-cpu.yaml: BERT 4 x 128 with LAMB;
schedules/gpt2-tiny-cpu.yaml: GPT-2 4 x 128 with AdamW) it measures ONE profile with `pipefisher
profile` at the run file's own split (2 stages, 1F1B, 4 micro-batches, the run file's optimizer;
K-FAC's tasks are timed too) and predicts every layout from it with the planner's `predict`
(`pipefisher.planning.planner.predict`, what `pipefisher plan` ranks by): other schedules and
micro-batch counts reuse the stages' times, interleaved's and a 1-stage pipeline's pieces are the
profile re-split by blocks (`layout_sources.resplit`), K-FAC is packed, and replicated stages
(Chimera's pipes, data-parallel copies) get the ring all-reduce of their gradients at the bandwidth
of the profile's measured stage-boundary transfer. Then it runs every layout with `pipefisher run
--json` (2 processes each), in turn. The rounds repeat (profiles, A B C ...; profiles, A B C ...),
so that a prediction and the runs it predicts share the machine's state of the moment (on a machine
shared with other work, one profile taken minutes before the runs put every layout of a model off
by the same 10-20 %). A run's value is the median over its timed refresh cycles (1 step each for a
first-order optimizer) of the cycle's mean step time (rank 0's `step_time_ms`), after the warm-up
steps. Per layout: the median prediction and measurement over rounds, and the error, the median
over rounds of predicted / measured - 1 (paired within a round). Reported: those, the spread of
the measurements, and Spearman's rank correlation of predicted against measured.

    python experiments/plan_check.py --out docs/plan_check.md                      # the checked layouts
    python experiments/plan_check.py --layouts held-out --out docs/plan_check_held_out.md  # six others
    python experiments/plan_check.py --layouts uneven --out docs/plan_check_uneven.md  # uneven stage splits
    python experiments/plan_check.py --quick                                        # 3 layouts, 1 round

`--layouts uneven` pairs layouts on the even split with the same layouts on `pipeline.stage_blocks`
[3, 1] (the split `pipefisher plan` proposes for both models): their predictions cut the even
profile by block, and the page adds each pair's ratio, predicted against measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipefisher.config import RunConfig, config_from_dict  # noqa: E402
from pipefisher.core.profile import Profile, load_profile  # noqa: E402
from pipefisher.core.stage_split import counts_text  # noqa: E402
from pipefisher.planning.planner.candidates import layout_of_run  # noqa: E402
from pipefisher.planning.planner.model_sizes import model_sizes  # noqa: E402
from pipefisher.planning.planner.predict import PlanContext, predict, source_bandwidth_gbps  # noqa: E402
from pipefisher.planning.planner.sources import MeasuredTimes  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402

MODELS = {"bert-4x128": "schedules/tiny-cpu.yaml", "gpt2-tiny": "schedules/gpt2-tiny-cpu.yaml"}
FIRST_ORDER = ("sgd", "adamw", "lamb")
RUN_TIMEOUT_S = 600.0
#: schedules that split the backward (`--split-profile` profiles the first for their layouts)
SPLIT = ("zb-h1", "zbv", "dualpipev")
#: a model's profiles of one round: (file, profile), its run file's layout first
Profiles = list[tuple[Path, Profile]]


@dataclass(frozen=True)
class Case:
    """One way to run a model: `stages` pipeline stages x `data_parallel` replicas (one process each),
    `micro_batches` per replica and step, `method` the optimizer (a first-order one, or a curvature
    method packed into the bubbles), `stage_blocks` the blocks of each stage (empty: even)."""

    model: str
    schedule: str
    stages: int
    micro_batches: int
    method: str
    data_parallel: int = 1
    stage_blocks: tuple[int, ...] = ()

    @property
    def processes(self) -> int:
        return self.stages * self.data_parallel

    @property
    def label(self) -> str:
        split = f"{self.stages} st" + (f" x {self.data_parallel} dp" if self.data_parallel > 1 else "")
        blocks = f" (blocks {counts_text(self.stage_blocks)})" if self.stage_blocks else ""
        return f"{self.schedule}, {split}{blocks}, N={self.micro_batches}, {self.method}"


def layouts(which: str, quick: bool) -> list[Case]:
    """The checked layouts (`which`: "checked", "held-out": six others of the same models, never used
    to tune the planner, "all", or "uneven": five layouts each on the even split and on [3, 1]),
    all on 2 processes (this machine has 2 cores: more processes than cores time-share them, which
    no per-device model predicts)."""
    bert, gpt2 = "bert-4x128", "gpt2-tiny"
    held_out = [
        Case(bert, "chimera", 2, 8, "lamb"),
        Case(bert, "zb-h1", 2, 8, "lamb"),
        Case(bert, "gpipe", 2, 2, "lamb"),
        Case(bert, "1f1b", 2, 8, "kfac"),
        Case(gpt2, "chimera", 2, 4, "adamw"),
        Case(gpt2, "zb-h1", 2, 4, "adamw"),
    ]
    checked = [
        Case(bert, "1f1b", 2, 4, "lamb"),
        Case(bert, "gpipe", 2, 4, "lamb"),
        Case(bert, "1f1b", 2, 8, "lamb"),
        Case(bert, "1f1b", 2, 2, "lamb"),
        Case(bert, "chimera", 2, 4, "lamb"),
        Case(bert, "zb-h1", 2, 4, "lamb"),
        Case(bert, "interleaved", 2, 4, "lamb"),
        Case(bert, "1f1b", 2, 4, "kfac"),
        Case(bert, "1f1b", 1, 4, "lamb", data_parallel=2),
        Case(gpt2, "1f1b", 2, 4, "adamw"),
        Case(gpt2, "gpipe", 2, 8, "adamw"),
    ]
    paired = [
        Case(bert, "1f1b", 2, 4, "lamb"),
        Case(bert, "1f1b", 2, 4, "kfac"),
        Case(gpt2, "1f1b", 2, 4, "adamw"),
        Case(gpt2, "1f1b", 2, 4, "kfac"),
        Case(gpt2, "zb-h1", 2, 4, "adamw"),
    ]
    uneven = [replace(case, stage_blocks=blocks) for case in paired for blocks in ((), (3, 1))]
    chosen = {"checked": checked, "held-out": held_out, "all": checked + held_out, "uneven": uneven}[which]
    return [chosen[0], chosen[1], chosen[-1]] if quick else chosen


def run_config(case: Case) -> RunConfig:
    """The run file of `case.model` with the layout's keys set."""
    data = yaml.safe_load((ROOT / MODELS[case.model]).read_text())
    data["pipeline"].update(
        schedule=case.schedule, stages=case.stages, micro_batches=case.micro_batches, data_parallel=case.data_parallel
    )
    if case.stage_blocks:
        data["pipeline"]["stage_blocks"] = list(case.stage_blocks)
    data["optimizer"]["name"] = case.method
    return config_from_dict(data)


def layout_flags(case: Case, profile: Path) -> list[str]:
    """`pipefisher run` flags that make the model's run file run `case` (a curvature method packs
    from `profile`, the profile the prediction uses, and never re-profiles)."""
    flags = [
        "--schedule",
        case.schedule,
        "--pipeline.stages",
        str(case.stages),
        "--pipeline.micro_batches",
        str(case.micro_batches),
        "--data-parallel",
        str(case.data_parallel),
        "--optimizer",
        case.method,
    ]
    if case.schedule == "interleaved":
        flags += ["--pipeline.chunks", "2"]
    if case.stage_blocks:
        flags += ["--pipeline.stage_blocks", json.dumps(list(case.stage_blocks))]
    if case.method not in FIRST_ORDER:
        flags += ["--profile", str(profile), f"--{case.method}.reprofile_threshold", "1000"]
    return flags


def planner_context(case: Case, profiles: Profiles) -> PlanContext:
    """The planner's context for `case`'s model and method, times from the measured profiles (the
    model's one, and with `--split-profile` one under ZB-H1 that split-backward layouts take);
    the data-parallel bandwidth is the profile's stage-boundary transfer (one micro-batch's
    activation, micro-batch x sequence x hidden fp32, over its measured p2p time), not the planner's
    default for InfiniBand between GPUs."""
    config = run_config(case)
    sizes = model_sizes(config)
    curvature = case.method not in FIRST_ORDER
    source = MeasuredTimes.check([(str(path), profile) for path, profile in profiles], sizes, None)
    return PlanContext(
        sizes,
        source,
        config.section(case.method).first_order if curvature else case.method,
        config.section(case.method) if curvature else None,
        config.optimizer_settings.momentum,
        config.run.precision,
        source_bandwidth_gbps(source, sizes, config.run.precision),
    )


def predict_case(case: Case, profiles: Profiles) -> tuple[float, int]:
    """(predicted mean step time in ms, refresh interval k: 1 for first-order) of `case`: the
    layout planner's `predict` of the run file's layout."""
    config = run_config(case)
    layout = layout_of_run(config.pipeline, config.data.micro_batch_size, case.method)  # its stage_blocks too
    prediction = predict(layout, planner_context(case, profiles))
    return prediction.step_ms, max(prediction.layout.refresh_steps, 1)


#: measured steps of the one profile per model (medians): at the profile's default of 5, the same layout's
#: prediction moved by 15 % between two profiles taken minutes apart
PROFILE_REPEATS = 15


def measure_profile(model: str, folder: Path, schedule: str | None = None) -> Path:
    """The model's profile at its run file's layout (`schedule`: under that schedule instead)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f"{model}-{schedule}.yaml" if schedule else f"{model}.yaml")
    command = [
        sys.executable,
        "-m",
        "pipefisher",
        "profile",
        MODELS[model],
        "-o",
        str(path),
        "--master-port",
        "0",
        "--repeats",
        str(PROFILE_REPEATS),
        *(["--schedule", schedule] if schedule else []),
    ]
    call(command)
    return path


def call(command: list[str]) -> str:
    """stdout of `command` run from the checkout; RuntimeError with its last stderr line on failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{shlex.join(command[1:])} exited with {done.returncode}: {last}")
    return done.stdout


def measure_run(case: Case, profile: Path, refresh_steps: int, warmup: int, timed: int) -> float:
    """Median over the timed refresh cycles of one fresh run of the cycle's mean step time (ms)."""
    cycles_warm, cycles_timed = -(-warmup // refresh_steps), -(-timed // refresh_steps)
    steps = (cycles_warm + cycles_timed) * refresh_steps
    command = [
        sys.executable,
        "-m",
        "pipefisher",
        "run",
        MODELS[case.model],
        "--json",
        "--master-port",
        "0",
        "--steps",
        str(steps),
        *layout_flags(case, profile),
    ]
    records = [json.loads(line) for line in call(command).splitlines() if line.startswith("{")]
    if len(records) != steps:
        raise RuntimeError(f"{case.label}: the run reported {len(records)} steps, not {steps}")
    if records[-1].get("refresh_steps", 1) != refresh_steps:
        raise RuntimeError(
            f"{case.label}: the run refreshed every {records[-1]['refresh_steps']} steps, "
            f"the prediction every {refresh_steps}"
        )
    times = [record["step_time_ms"] for record in records[cycles_warm * refresh_steps :]]
    return statistics.median(
        statistics.fmean(times[i : i + refresh_steps]) for i in range(0, len(times), refresh_steps)
    )


def spearman(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic)


def table(rows: list[dict]) -> str:
    lines = [
        "| model | schedule | stages x replicas | micro-batches | optimizer | processes | predicted [ms] | "
        "measured median [ms] | measured min–max [ms] | error [%] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lay = row["layout"]
        ks = "–".join(str(k) for k in sorted({min(row["refresh_steps"]), max(row["refresh_steps"])}))
        packed = f" (packed, k={ks})" if lay["method"] not in FIRST_ORDER else ""
        blocks = f" (blocks {counts_text(lay['stage_blocks'])})" if lay["stage_blocks"] else ""
        lines.append(
            f"| {lay['model']} | {lay['schedule']} | {lay['stages']} x {lay['data_parallel']}{blocks} | {lay['micro_batches']} | "
            f"{lay['method']}{packed} | "
            f"{row['processes']} | {row['predicted_ms']:.1f} | {row['measured_ms']:.1f} | "
            f"{min(row['repeats_ms']):.1f}–{max(row['repeats_ms']):.1f} | {row['error'] * 100:+.1f} |"
        )
    return "\n".join(lines)


def report(rows: list[dict], args: argparse.Namespace, seconds: float, load: str) -> tuple[str, float, float]:
    """The Markdown page, Spearman's rho and the largest absolute error (a share)."""
    rho = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
    worst = max(abs(r["error"]) for r in rows)
    return (
        "\n".join(
            [
                "# Layout predictions against measured steps",
                "",
                "Written by `experiments/plan_check.py` (its docstring has the method). Back to the [README](../README.md).",
                "",
                f"Command: `python {shlex.join(['experiments/plan_check.py', *sys.argv[1:]])}` ({seconds / 60:.1f} min)",
                "",
                f"CPU ({os.cpu_count()} cores, 1 thread per process, gloo); load average {load} (1, 5, 15 min) at the start and at the end. "
                f"{args.repeats} rounds, each: one profile per model (`pipefisher profile RUN.yaml --repeats {PROFILE_REPEATS}`: "
                "2 stages, 1F1B, 4 micro-batches"
                + ("; and one under ZB-H1, which the split-backward layouts take" if args.split_profile else "")
                + "), then every layout predicted from it and run once in turn: "
                f"{args.warmup} warm-up steps, then {args.steps} timed steps (whole refresh cycles). Predicted and measured: "
                "medians over rounds; error: the median over rounds of predicted / measured − 1 in the same round.",
                "",
                table(rows),
                "",
                f"Spearman's rank correlation of predicted against measured: **{rho:.3f}**; largest error "
                f"**{worst * 100:.1f} %**.",
                "",
                *split_ratios(rows),
                *NOTES,
            ]
        ),
        rho,
        worst,
    )


def split_ratios(rows: list[dict]) -> list[str]:
    """Lines of the page for each layout run on an uneven split beside its even twin: the step's
    ratio, predicted and measured (medians over rounds of the ratios paired within a round)."""
    by_layout = {
        json.dumps({**row["layout"], "stage_blocks": list(row["layout"]["stage_blocks"])}): row for row in rows
    }
    lines = []
    for row in rows:
        if not row["layout"]["stage_blocks"]:
            continue
        twin = by_layout.get(json.dumps({**row["layout"], "stage_blocks": []}))
        if twin is None:
            continue
        predicted = statistics.median(
            a / b for a, b in zip(row["predicted_per_round_ms"], twin["predicted_per_round_ms"])
        )
        measured = statistics.median(a / b for a, b in zip(row["repeats_ms"], twin["repeats_ms"]))
        lay = row["layout"]
        lines.append(
            f"- {lay['model']}, {lay['schedule']}, {lay['method']}: blocks {counts_text(lay['stage_blocks'])} over the "
            f"even split, predicted **{predicted:.3f}x**, measured **{measured:.3f}x**"
        )
    return ["Uneven splits against the even split (same round):", "", *lines, ""] if lines else []


#: what the page says below every table: what the numbers are and what the prediction leaves out
NOTES = [
    "Predicted: `pipefisher.planning.planner.predict.predict` (what `pipefisher plan` ranks by) on the round's one "
    "profile of the model. Every layout runs 2 single-threaded processes on the 2 cores: "
    "with 4 processes two ranks share each core and the operating system's time slicing, not the schedule, decides "
    "when an op runs, which no per-device model describes (a 4-process layout here measures the scheduler, so none "
    "is in the check).",
    "",
    "What the prediction leaves out, by construction:",
    "",
    "- K-FAC's end of step is the profiled optimizer's (LAMB or AdamW over every parameter): K-FAC steps its layers "
    "with SGD and the rest with AdamW, and preconditions (the profile's per-layer `precondition`).",
    "- Stage times come from the 1F1B run the profile measured, where one rank idles in the bubbles; layouts that "
    "keep both ranks busy all the time (Chimera, data parallelism) share the machine's memory bandwidth and any "
    "other load with the second rank throughout.",
    "- Interleaved pieces and the 1-stage pipeline are the 2-stage profile re-split by blocks "
    "(`layout_sources.resplit`): a stage's time is shared out by the forward flops each piece takes (a block's; "
    "the heads' with the last piece; the embeddings' lookups none), which assumes time splits like flops, and the "
    "1-stage pipeline's end of step is "
    "the larger of the two stages' (mostly fixed costs: the all-reduce of BERT's tied embedding/decoder weights, "
    "the step's world reduction, starting the optimizer), not their sum.",
    "- The data-parallel gradient all-reduce runs at the bandwidth of the profile's stage-boundary transfer (one "
    "activation message over its measured p2p time, latency included).",
    "",
    "Why the errors here exceed 5 %, and what the schedules change: [Plan accuracy](plan_accuracy.md).",
]


@dataclass
class Rounds:
    """Per layout, one entry per round: the prediction from that round's profile (ms, k) and the
    run's measured time (ms)."""

    predicted: dict[Case, list[tuple[float, int]]]
    measured: dict[Case, list[float]]
    profiles: list[dict[str, list[str]]]  # per round: model -> its profile files


def predict_and_measure(chosen: list[Case], args: argparse.Namespace) -> Rounds:
    """Every round: a profile per model, then each layout predicted from it and run. RuntimeError
    (one line) when a profile or run fails."""
    rounds = Rounds({case: [] for case in chosen}, {case: [] for case in chosen}, [])
    for repeat in range(args.repeats):
        profiles: dict[str, Profiles] = {}
        for model in dict.fromkeys(case.model for case in chosen):
            split = args.split_profile and any(c.model == model and c.schedule in SPLIT for c in chosen)
            for schedule in (None, SPLIT[0]) if split else (None,):
                path = measure_profile(model, args.profile_dir / f"round-{repeat + 1}", schedule)
                profiles.setdefault(model, []).append((path, load_profile(path)))
                print(f"round {repeat + 1}/{args.repeats}: profiled {model}: {path}", file=sys.stderr, flush=True)
        rounds.profiles.append({model: [str(path) for path, _ in found] for model, found in profiles.items()})
        for case in chosen:
            predicted, k = predict_case(case, profiles[case.model])
            value = measure_run(case, profiles[case.model][0][0], k, args.warmup, args.steps)
            rounds.predicted[case].append((predicted, k))
            rounds.measured[case].append(value)
            print(
                f"round {repeat + 1}/{args.repeats} {case.label}: {value:.1f} ms (predicted {predicted:.1f} ms)",
                file=sys.stderr,
                flush=True,
            )
    return rounds


def row_of(case: Case, rounds: Rounds) -> dict:
    """The page's and the JSON's row of `case`: medians over rounds, the paired error's median."""
    predicted, measured = rounds.predicted[case], rounds.measured[case]
    ks = sorted({k for _, k in predicted})
    return {
        "layout": asdict(case),
        "processes": case.processes,
        "predicted_ms": statistics.median(ms for ms, _ in predicted),
        "refresh_steps": ks,
        "measured_ms": statistics.median(measured),
        "repeats_ms": measured,
        "predicted_per_round_ms": [ms for ms, _ in predicted],
        "error": statistics.median(ms / value - 1 for (ms, _), value in zip(predicted, measured)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds: profiles, then one fresh run per layout (median; default 3)"
    )
    parser.add_argument(
        "--layouts",
        choices=("checked", "held-out", "all", "uneven"),
        default="checked",
        help="which layouts (default checked)",
    )
    parser.add_argument(
        "--split-profile",
        action="store_true",
        help="also profile each model under ZB-H1 every round; its split-backward layouts are predicted from that",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run (default 3)")
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps per run, rounded up to whole refresh cycles (default 5)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 3 layouts, 1 repeat, 1 warm-up and 2 timed steps"
    )
    parser.add_argument("--out", type=Path, help="write the Markdown table here and the raw numbers beside it (.json)")
    parser.add_argument(
        "--profile-dir",
        type=Path,
        default=Path("/tmp/pipefisher-experiments/plan_check"),
        help="where the measured profiles go",
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 1, 2
    for flag in ("repeats", "warmup", "steps"):
        if getattr(args, flag) < 1:
            print(f"plan_check: error: --{flag}: {getattr(args, flag)} is not a positive count", file=sys.stderr)
            return 2
    started, load_at_start = time.perf_counter(), os.getloadavg()
    chosen = layouts(args.layouts, args.quick)
    try:
        rounds = predict_and_measure(chosen, args)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"plan_check: {exc}", file=sys.stderr)
        return 1
    rows = [row_of(case, rounds) for case in chosen]
    load = " and ".join(" ".join(f"{x:.2f}" for x in loads) for loads in (load_at_start, os.getloadavg()))
    seconds = time.perf_counter() - started
    text, rho, worst = report(rows, args, seconds, load)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(
            json.dumps(
                {
                    "command": sys.argv,
                    "seconds": seconds,
                    "load_average": load,
                    "spearman": rho,
                    "max_abs_error": worst,
                    "profiles": rounds.profiles,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "plan_check"))
