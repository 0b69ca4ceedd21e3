"""experiments/time_budget.py (issue 47, item 4, prepared for a GPU): its report on constructed
runs, its run commands, and a CPU run end to end on a budget of seconds."""

import argparse
import json
from pathlib import Path

import pytest

from experiments.time_budget import CPU_SIZE, _rates, command, main, report
from experiments.time_to_target_study.runs import parse_records


def constructed(losses: list[float], step_ms: float, every: int = 5) -> object:
    records = []
    for step in range(1, every * len(losses) + 1):
        record = {"step": step, "step_time_ms": step_ms, "train_s": step * step_ms / 1000}
        if step % every == 0:
            record["eval_loss"] = losses[step // every - 1]
        records.append(record)
    return parse_records(records, wall_s=0.0)


def test_the_report_times_every_method_to_the_first_methods_final_loss():
    """AdamW ends at 3.0 after 20 steps of 100 ms (2.0 s); Muon, at 200 ms a step, passes 3.0 half
    way between its evaluations at 1.0 s (3.5) and 2.0 s (2.5): 1.5 s, 0.75 x AdamW's."""
    runs = {"adamw": constructed([5.0, 4.0, 3.5, 3.0], 100), "muon": constructed([3.5, 2.5, 2.0, 1.8], 200)}
    args = argparse.Namespace(budget=4.0, lr={}, source_mb=1.0)
    table = report(runs, args, CPU_SIZE)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines() if line.startswith("| ")}
    assert "Target: adamw's final held-out loss, 3.0000" in table
    assert rows["adamw"][6:] == ["2.0", "1.00 |"]
    assert rows["muon"][2:] == ["20", "200.0", "10,240", "1.8000", "1.5", "0.75 |"]


def test_learning_rates_are_method_value_pairs():
    assert _rates("adamw=6e-4,muon=0.02") == {"adamw": 6e-4, "muon": 0.02}
    with pytest.raises(argparse.ArgumentTypeError, match="METHOD=LR pairs"):
        _rates("adamw:6e-4")


def test_a_method_run_is_one_stage_after_step_with_the_adamw_rate_for_the_rest(tmp_path):
    lr = {"adamw": 6e-4, "soap": 3e-3}
    argv = command("soap", lr, CPU_SIZE, tmp_path / "shards", 40, tmp_path / "m.jsonl")
    assert argv[argv.index("--steps") + 1] == "40" and argv[argv.index("--optimizer") + 1] == "soap"
    pairs = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert pairs["--pipeline.stages"] == "1" and pairs["--soap.placement"] == "after-step"
    assert pairs["--optimizer.lr"] == "0.0006" and pairs["--soap.lr"] == "0.003"
    assert pairs["--optimizer.warmup_steps"] == "2", "warm-up over 5 % of the steps"


@pytest.mark.slow
def test_a_cpu_run_ends_every_method_on_its_budget(tmp_path, capsys):
    """AdamW on GPT-2 tiny, 3 s: its timed run ends on its budget (or its steps), within one step
    of it, evaluated at its end; the report has its row (a second method's row: the constructed
    runs above; each method's run is the same command with its own section)."""
    out = tmp_path / "budget"
    argv = ["--quick", "--methods", "adamw", "--budget", "3", "--calibrate", "8", "--evals", "2"]
    assert main(argv + ["--source-mb", "2", "--cache", str(tmp_path / "cache"), "--out", str(out)]) == 0
    table = out.with_suffix(".md").read_text()
    assert "| adamw | 0.0006 |" in table
    records = [json.loads(line) for line in Path(f"{out}-records/adamw.jsonl").read_text().splitlines()]
    last = records[-1]
    assert "eval_loss" in last
    step_s = last["step_time_ms"] / 1000
    assert last.get("out_of_time") or len(records) == last["step"]
    assert last["train_s"] <= 3 + 2 * step_s + 0.5, "the budget ends the run within a step of it"
    assert out.with_suffix(".csv").is_file() and out.with_suffix(".png").is_file()
