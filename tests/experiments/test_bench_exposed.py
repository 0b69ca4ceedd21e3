"""experiments/bench_exposed.py: a quick paired run of first-order against one method reports its
ratio over whole refresh cycles and each rank's busy and idle time; the windows, intervals and
flags it relies on; bad flags are one line and exit 2."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "bench_exposed.py"
sys.path.insert(0, str(ROOT))

from experiments.exposed.arms import Layout, cycle_window  # noqa: E402
from experiments.exposed.stats import log_ratio_interval, t_975  # noqa: E402
from experiments.common import RunFailed  # noqa: E402
from experiments.overhead.workloads import WORKLOADS  # noqa: E402


def bench(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def cells(text: str, prefix: str) -> list[str]:
    row = next(line for line in text.splitlines() if line.startswith(prefix))
    return [cell.strip() for cell in row.strip("|").split("|")]


@pytest.mark.slow
def test_the_quick_run_pairs_first_order_with_the_method_over_whole_cycles(tmp_path):
    out = tmp_path / "exposed.md"
    result = bench("--quick", "--out", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text == result.stdout
    assert "Command: `python experiments/bench_exposed.py --quick" in text
    assert "4 micro-batches of 2 = 512 tokens per step" in text  # sequences of 64
    row = cells(text, "| 1f1b | K-FAC | 1 |")
    first_order, method = float(row[3]), float(row[4])
    ratio = float(row[5].split()[0])
    assert first_order > 0 and method > 0 and math.isfinite(ratio) and ratio > 0
    # one row per method and schedule: --quick is 1f1b and the registry's first method
    assert sum(line.startswith("| 1f1b |") for line in text.splitlines()) == 1 + 2  # ratio row, 2 traced arms
    data = json.loads(out.with_suffix(".json").read_text())
    (pair,) = data["pairs"]
    assert len(pair["ratios"]) == 2 and pair["refresh_steps"] == [1, 1]
    runs = {(run["repeat"], run["arm"]): run for run in data["runs"]}
    assert {run["tokens_per_step"] for run in data["runs"]} == {512}
    assert sorted(runs) == [(0, "K-FAC"), (0, "adamw"), (1, "K-FAC"), (1, "adamw")]
    for repeat in range(2):
        # k = 1, 1 warm-up step, 2 cycles: steps 2 and 3 timed; the last repeat traces one more after a gap step
        assert [len(runs[repeat, arm]["step_ms"]) for arm in ("adamw", "K-FAC")] == [3 + 2 * repeat] * 2
        for arm, key in (("adamw", "first_order_ms"), ("K-FAC", "method_ms")):
            assert pair[key][repeat] == pytest.approx(sum(runs[repeat, arm]["step_ms"][1:3]) / 2)
        assert pair["ratios"][repeat] == pytest.approx(pair["method_ms"][repeat] / pair["first_order_ms"][repeat])
    assert [t["label"] for t in data["traced"]] == ["adamw", "K-FAC"]
    for traced in data["traced"]:
        assert [r["rank"] for r in traced["ranks"]] == [0, 1]
        assert all(0 <= r["idle_ms"] < r["step_ms"] for r in traced["ranks"])
    assert "1f1b repeat 2/2 K-FAC: ratio" in result.stderr


def test_a_bad_flag_is_one_line_and_exit_2():
    result = bench("--methods", "kfac,adam", "--repeats", "1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bench_exposed: error: --methods: 'adam' is not one of kfac, shampoo, muon, soap"
    ]
    result = bench("--cycles", "0")
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "bench_exposed: error: --cycles: 0 is not a positive count",
    )


def test_the_timed_window_is_whole_cycles_after_the_warm_up():
    assert cycle_window(5, 2, 15) == range(5, 15)
    assert cycle_window(4, 0, 10) == range(0, 8)
    assert cycle_window(3, 3, 10) == range(3, 9)
    with pytest.raises(RunFailed, match="k=6"):
        cycle_window(6, 2, 11)


def test_a_run_has_room_for_the_warm_up_and_the_cycles_at_any_k_it_may_get():
    fixed = Layout(WORKLOADS["gpt2-tiny"], "zb-h1", 4, 32, "adamw", 5, 10, 2, 2)
    assert fixed.steps == 15 and cycle_window(5, 2, fixed.steps) == range(5, 15)
    packer = Layout(WORKLOADS["gpt2-tiny"], "1f1b", 4, 32, "adamw", 0, 10, 2, 2)
    assert all(len(cycle_window(k, 2, packer.steps)) >= 2 * k for k in range(1, 11))
    flags = packer.flags("muon", packer.steps, None)
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs["--optimizer.name"] == "muon" and pairs["--muon.placement"] == "packed"
    assert pairs["--muon.refresh_steps"] == "0" and pairs["--muon.max_refresh_steps"] == "10"
    assert pairs["--pipeline.schedule"] == "1f1b" and pairs["--run.steps"] == "32"
    assert "--muon.reprofile_threshold" in pairs and "--run.trace" not in pairs
    first_order = dict(zip(*[iter(fixed.flags(None, 15, None))] * 2))
    assert first_order["--optimizer.name"] == "adamw" and not any(f.startswith("--kfac") for f in first_order)


def test_the_interval_is_students_t_on_the_log_ratios():
    interval = log_ratio_interval([math.exp(0.1), math.exp(0.3)])
    assert interval.centre == pytest.approx(math.exp(0.2))
    # sd of (0.1, 0.3) is 0.1414, its standard error 0.1; t(0.975, 1) = 12.706
    assert (interval.low, interval.high) == pytest.approx((math.exp(0.2 - 1.2706), math.exp(0.2 + 1.2706)))
    assert log_ratio_interval([1.02]) is None
    assert t_975(4) == 2.776 and t_975(30) == 2.042 and t_975(1000) == 1.96
