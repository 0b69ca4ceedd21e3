"""experiments/time_to_target.py: its measures on constructed curves (steps and seconds to a
target, the consistency check, the step records' clock), and its --quick study end to end with
real pipelined runs, resumed from its runs' records."""

import dataclasses
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.time_to_target_study.report import (
    Arm,
    apart,
    disagreement,
    flagged,
    results_table,
    seconds_to,
    steps_to,
)
from experiments.time_to_target_study.runs import PipelinedRun, Setting, parse_records

ROOT = Path(__file__).resolve().parents[1]


def constructed(losses: list[float], step_ms: float, every: int = 10, start_ms: float | None = None) -> PipelinedRun:
    """A run evaluated every `every` steps with `losses`, every step `step_ms` long (the first
    `start_ms`, when given), built through the step records as a real run's are."""
    records = []
    for step in range(1, every * len(losses) + 1):
        record = {"step": step, "step_time_ms": start_ms if step == 1 and start_ms else step_ms}
        if step % every == 0:
            record["eval_loss"] = losses[step // every - 1]
        records.append(record)
    return parse_records(records, wall_s=0.0)


def test_records_give_the_clock_of_the_steps_before_each_evaluation():
    run = parse_records(
        [
            {"step": 1, "step_time_ms": 100.0},
            {"step": 2, "step_time_ms": 300.0, "eval_loss": 5.0, "refresh_steps": 7},
            {"step": 3, "step_time_ms": 200.0, "exposed_share": 0.25, "refresh_steps": 7},
            {"step": 4, "step_time_ms": 200.0, "eval_loss": float("nan"), "refresh_steps": 7},
        ],
        wall_s=9.0,
    )
    assert run.evals == [(2, 5.0), (4, math.inf)]
    assert run.clock == [(pytest.approx(0.4), 5.0), (pytest.approx(0.8), math.inf)]
    assert run.exposed_share == 0.25 and run.k == 7 and run.median_step_ms == 200.0


def test_the_runs_own_training_clock_and_bert_mlm_loss_win_where_recorded():
    """`train_s` includes host work between steps that `step_time_ms` misses; BERT's MLM part is its loss."""
    run = parse_records(
        [
            {"step": 1, "step_time_ms": 100.0, "train_s": 0.15},
            {"step": 2, "step_time_ms": 300.0, "train_s": 0.5, "eval_loss": 5.5, "eval_mlm": 5.0},
        ],
        wall_s=1.0,
    )
    assert run.clock == [(0.5, 5.0)] and run.evals == [(2, 5.0)]


def test_steps_and_seconds_to_target_interpolate_between_evaluations():
    run = constructed([6.0, 5.0, 4.0, 3.0], step_ms=50.0)  # evaluations at steps 10..40, 0.5 s apart
    assert steps_to(run, 4.5) == pytest.approx(25.0)
    assert seconds_to(run, 4.5) == pytest.approx(1.25)
    assert steps_to(run, 6.5) == 10.0 and seconds_to(run, 6.5) == pytest.approx(0.5)
    assert math.isinf(steps_to(run, 2.0)) and math.isinf(seconds_to(run, 2.0))


def test_the_consistency_check_flags_seconds_that_the_step_time_does_not_explain():
    steady = constructed([6.0, 5.0, 4.0, 3.0], step_ms=50.0)
    slow_start = constructed([6.0, 5.0, 4.0, 3.0], step_ms=50.0, start_ms=1050.0)  # 1 s more before step 2
    for run, off in ((steady, 0.0), (slow_start, 1.0 / 1.25)):
        seconds, steps = seconds_to(run, 4.5), steps_to(run, 4.5)
        assert disagreement(seconds, steps, run.median_step_ms) == pytest.approx(off)
    assert not flagged(1.25, 25.0, 50.0) and flagged(2.25, 25.0, 50.0) and flagged(0.9, 25.0, 50.0)
    assert not flagged(1.36, 25.0, 50.0, tolerance=0.1) and flagged(1.39, 25.0, 50.0, tolerance=0.1)
    assert flagged(math.inf, 25.0, 50.0), "reached in steps but never on the clock"
    assert not flagged(math.inf, math.inf, 50.0)


def test_the_table_compares_each_method_with_adamw_on_its_schedule():
    adamw = Arm(Setting("gpt2", "1f1b", "adamw", 1e-3, 0), [constructed([6.0, 5.0, 4.0, 3.0], 100.0)])
    fast = Arm(Setting("gpt2", "1f1b", "kfac", 0.1, 0, 1e-3), [constructed([5.0, 4.0, 3.0, 2.0], 150.0)])
    odd = Arm(Setting("gpt2", "zb-h1", "adamw", 1e-3, 0), [constructed([6.0, 5.0, 4.0, 3.0], 100.0, start_ms=2100.0)])
    rows = results_table([adamw, fast, odd], target=3.0)
    assert rows[2].startswith("| adamw | 1f1b | 0.001 | 3.000 | 40 (40) | 1.00 | 4.0 (4.0) | 1.00 | 100.0 | 1.00 |")
    kfac = rows[3].split(" | ")
    assert kfac[4:10] == ["30 (30)", "0.75", "4.5 (4.5)", "1.12", "150.0", "1.50"] and rows[3].endswith("| ok (+0 %) |")
    assert kfac[11] == "yes / no", "K-FAC's one seed needs fewer steps than AdamW's, but more seconds"
    assert rows[2].split(" | ")[11] == "–", "AdamW is not compared with itself"
    assert rows[4].endswith("| 4.0 | FLAG (+50 %) |"), "2 s more on the clock than 40 steps of 100 ms"


def test_seeds_are_apart_only_when_the_slowest_beats_adamws_fastest():
    assert apart([250.0, 280.0], [300.0, 320.0]) and not apart([250.0, 310.0], [300.0, 320.0])
    assert not apart([250.0, math.inf], [300.0]), "a seed that never reached the target overlaps"
    assert apart([250.0], [math.inf, math.inf]) and not apart([], [300.0])


def study_command(*args: str, timeout: float) -> subprocess.CompletedProcess:
    script = ROOT / "experiments" / "time_to_target.py"
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
    )


def study(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return study_command("--quick", *args, timeout=timeout)


@pytest.mark.dist
@pytest.mark.slow  # 2 real 2-process runs of 10 steps: about a minute here
def test_the_quick_study_runs_pipelined_and_resumes_from_its_cache(tmp_path):
    out, cache = tmp_path / "ttt", tmp_path / "cache"
    first = study("--schedules", "zb-h1", "--cache", str(cache), "--out", str(out), timeout=600)
    assert first.returncode == 0, first.stderr
    text = out.with_suffix(".md").read_text()
    assert "Runs: 2 trained now, 0 from their records" in text
    assert re.search(r"Measured on: [^;]+, \d+ cores, [^;]+ \(2 runs\)\.", text), "each record names its machine"
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| adamw | ", "| kfac | "))]
    table = [row for row in rows if len(row) == 14]
    assert sorted((row[0], row[1]) for row in table) == [("| adamw", "zb-h1"), ("| kfac", "zb-h1")]
    for row in table:
        assert all(math.isfinite(float(row[i])) for i in (3, 8)), row  # final held-out loss, median step [ms]
        if row[0] == "| adamw":
            assert float(row[5]) == 1.0 and float(row[4].split()[0]) > 0 and float(row[6].split()[0]) > 0
    csv_lines = out.with_suffix(".csv").read_text().splitlines()
    assert len(csv_lines) == 1 + 2 * 2, "2 runs, each evaluated after steps 5 and 10"
    assert out.with_suffix(".png").stat().st_size > 10_000
    start = time.perf_counter()
    fresh = tmp_path / "fresh"  # the runs' records alone resume the study, without its shards
    again = study(
        "--schedules", "zb-h1", "--cache", str(fresh), "--runs", str(cache / "runs"), "--out", str(out), timeout=120
    )
    assert again.returncode == 0, again.stderr
    assert "Runs: 0 trained now, 2 from their records" in out.with_suffix(".md").read_text()
    assert time.perf_counter() - start < 60 and not fresh.exists()


#: published studies whose every run's record is kept in the repository (docs/time_to_target_runs)
PUBLISHED = [
    ROOT / "docs" / "time_to_target_bert.md",
    ROOT / "docs" / "time_to_target.md",
    ROOT / "docs" / "time_to_target_bert_pinned.md",
    ROOT / "docs" / "time_to_target_pinned.md",
]


@pytest.mark.parametrize("page", PUBLISHED, ids=lambda page: page.name)
def test_a_published_study_is_made_of_its_kept_records(page, tmp_path):
    """Its command, training nothing (--cached-only), gives back every table row, target and
    evaluation (the CSV) of the page."""
    command = next(line for line in page.read_text().splitlines() if line.startswith("Command: `"))
    argv = command.split("`")[1].split()[2:]
    out = argv.index("--out")
    argv[out + 1] = str(tmp_path / "again")
    again = study_command(*argv, "--cached-only", timeout=120)
    assert again.returncode == 0, again.stderr
    kept = [line for line in page.read_text().splitlines() if line.startswith(("|", "Target:"))]
    regenerated = (tmp_path / "again.md").read_text().splitlines()
    assert kept and kept == [line for line in regenerated if line.startswith(("|", "Target:"))]
    assert (tmp_path / "again.csv").read_text() == page.with_suffix(".csv").read_text()


def test_pinned_refresh_intervals_follow_the_first_schedules_run_of_the_same_seed(tmp_path):
    """--pin-k: a curvature method's later schedules run at the k its packer chose on the first
    schedule for that seed; AdamW and the first schedule are left to themselves."""
    from experiments.time_to_target import SIZING, Study
    from experiments.time_to_target_study.runs import Store

    class Recorded(Study):
        """A study whose runs are the requested settings, each with a k of its own per seed."""

        def attempt(self, setting: Setting) -> PipelinedRun:
            self.asked.append(setting)
            run = constructed([5.0, 4.0], 100.0)
            return dataclasses.replace(run, k=setting.k or 3 + setting.seed)

    study = Recorded("gpt2", SIZING, ["1f1b", "zb-h1"], 2, Store(tmp_path, tmp_path), quick=False)
    study.asked, study.pin_k = [], True
    tuned = {"adamw": Setting("gpt2", "1f1b", "adamw", 1e-3, 0), "soap": Setting("gpt2", "1f1b", "soap", 1e-3, 0, 1e-3)}
    study.seeded(tuned)
    later = {(s.method, s.seed): s.k for s in study.asked if s.schedule == "zb-h1"}
    assert later == {("adamw", 0): 0, ("soap", 0): 3, ("adamw", 1): 0, ("soap", 1): 4}
    assert all(s.k == 0 for s in study.asked if s.schedule == "1f1b")


def test_refinement_tries_the_half_steps_either_side_of_each_settled_best(tmp_path):
    """--refine: once a grid's best is bracketed, its lr x ratio^(-1/2) and x ratio^(1/2) run for
    every method (AdamW too) and win where they are better; without it nothing more runs."""
    from experiments.time_to_target import SIZING, Study
    from experiments.time_to_target_study.report import final
    from experiments.time_to_target_study.runs import Store

    class Landscape(Study):
        """A study whose final loss is the squared log-distance of the lr from `optimum`."""

        optimum = 1e-3 * 3**0.5

        def attempt(self, setting: Setting) -> PipelinedRun:
            self.asked.append(setting.lr)
            return constructed([6.0, 5.0 + math.log(setting.lr / self.optimum) ** 2], 100.0)

    for refine in (False, True):
        study = Landscape("gpt2", SIZING, ["1f1b"], 1, Store(tmp_path, tmp_path), quick=False)
        study.asked, study.refine = [], refine
        best = study.tune(["soap"], 1e-3, final)["soap"]
        grid_points = [pytest.approx(lr) for lr in (1e-3 / 3, 1e-3, 3e-3)]
        assert study.asked == grid_points + [pytest.approx(1e-3 / 3**0.5), pytest.approx(1e-3 * 3**0.5)] * refine
        assert best.lr == pytest.approx(Landscape.optimum if refine else 1e-3)
