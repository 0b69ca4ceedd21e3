"""experiments/bench_exposed.py: a quick run alternates first-order and one method inside one
process group and reports their paired ratios and each rank's ops, end of step and waits; the
run configs, blocks, quiet rounds, intervals and flags it relies on; bad flags are one line and
exit 2."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "bench_exposed.py"
sys.path.insert(0, str(ROOT))

from experiments.exposed.arms import Layout  # noqa: E402
from experiments.exposed.group import cycles_of  # noqa: E402
from experiments.exposed.stats import Pair, grouped_interval, log_ratio_interval, ratio_table, t_975  # noqa: E402
from experiments.overhead.workloads import WORKLOADS  # noqa: E402


def bench(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def cells(text: str, prefix: str) -> list[str]:
    row = next(line for line in text.splitlines() if line.startswith(prefix))
    return [cell.strip() for cell in row.strip("|").split("|")]


@pytest.mark.slow
def test_the_quick_run_alternates_first_order_and_the_method_in_one_group(tmp_path):
    out = tmp_path / "exposed.md"
    result = bench("--quick", "--interleave", "--out", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text == result.stdout
    assert "Command: `python experiments/bench_exposed.py --quick --interleave" in text
    assert "interleaved step by step, a barrier before each step" in text
    assert "4 micro-batches of 2 = 512 tokens per step" in text  # sequences of 64
    row = cells(text, "| 1f1b | K-FAC | 1 |")
    first_order, method = float(row[3]), float(row[4])
    ratio = float(row[5].split()[0])
    assert first_order > 0 and method > 0 and math.isfinite(ratio) and ratio > 0
    assert row[7].endswith("of 2")  # quiet rounds
    # one row per method and schedule (--quick: 1f1b and the registry's first method), one per recorded arm
    assert sum(line.startswith("| 1f1b |") for line in text.splitlines()) == 1 + 2
    data = json.loads(out.with_suffix(".json").read_text())
    (pair,) = data["pairs"]
    assert pair["k"] == 1 and len(pair["ratios"]) == 2 and pair["all"]["rounds"] == 2
    (rank0, rank1) = data["groups"]["1f1b"]
    assert rank0["tokens_per_step"] == 512 and rank0["k"] == {"adamw": 1, "kfac": 1}
    # the slower rank's block times: the same figures on both ranks
    assert rank0["step_ms"] == rank1["step_ms"] and rank0["other_cores"] == rank1["other_cores"]
    assert pair["first_order_ms"] == rank0["step_ms"]["adamw"] and pair["method_ms"] == rank0["step_ms"]["kfac"]
    for r, (m, f) in enumerate(zip(pair["method_ms"], pair["first_order_ms"])):
        assert pair["ratios"][r] == pytest.approx(m / f)
    assert all(sorted(order) == ["adamw", "kfac"] for order in rank0["orders"])
    assert pair["own_estimate"] is not None and math.isfinite(pair["own_estimate"])
    assert [t["label"] for t in data["traced"]] == ["adamw", "K-FAC"]
    for traced in data["traced"]:
        assert [r["rank"] for r in traced["ranks"]] == [0, 1]
        for r in traced["ranks"]:
            assert r["ops_ms"] > 0 and r["end_ms"] >= 0 and 0 <= r["wait_ms"] < r["step_ms"]
    assert "1f1b round 2/2: adamw" in result.stderr


def test_a_bad_flag_is_one_line_and_exit_2():
    result = bench("--methods", "kfac,adam", "--repeats", "1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bench_exposed: error: --methods: 'adam' is not one of kfac, shampoo, muon, soap, kfac+helpers, shampoo+helpers, muon+helpers, soap+helpers"
    ]
    result = bench("--methods", "muon+helpers", "--schedules", "1f1b,chimera")
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "bench_exposed: error: --methods muon+helpers: not with --schedules chimera (help ops pair the ranks of one "
        "pipeline)",
    )
    for setting, said in [
        ("soap.statistics_dtype=float16", "--set: soap.statistics_dtype: 'float16' is not one of float64, float32"),
        ("kfac.refresh_steps=3", "--set 'kfac.refresh_steps=3': 'kfac' is not the section of a method of --methods"),
        ("soap.fold", "--set 'soap.fold': give SECTION.KEY=VALUE, e.g. soap.statistics_dtype=float32"),
    ]:
        result = bench("--methods", "soap", "--set", setting)
        assert (result.returncode, result.stderr.strip()) == (2, f"bench_exposed: error: {said}")
    result = bench("--min-steps", "0")
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "bench_exposed: error: --min-steps: 0 is not a positive count",
    )


def test_blocks_and_warm_ups_are_whole_cycles():
    assert [cycles_of(5, 5), cycles_of(5, 6), cycles_of(4, 2), cycles_of(1, 3), cycles_of(3, 0)] == [1, 2, 1, 3, 1]


def test_an_arms_run_config_differs_from_the_first_orders_only_in_its_optimizer():
    packer = Layout(WORKLOADS["gpt2-tiny"], "zb-h1", 4, 32, "adamw", 0, 10)
    first, muon = packer.config(None), packer.config("muon")
    assert first.optimizer.name == "adamw" and first.curvature is None
    assert muon.optimizer.name == "muon" and muon.curvature.placement == "packed"
    assert (muon.curvature.refresh_steps, muon.curvature.max_refresh_steps) == (0, 10)
    assert muon.curvature.reprofile_threshold >= 1e9 and muon.curvature.profile == ""
    for section in ("model", "data", "pipeline", "run"):
        assert getattr(first, section) == getattr(muon, section), section
    assert (first.pipeline.schedule, first.pipeline.stages, first.data.micro_batch_size) == ("zb-h1", 2, 32)
    assert Layout(WORKLOADS["gpt2-tiny"], "1f1b", 4, 32, "adamw", 5, 10).config("kfac").curvature.refresh_steps == 5
    settings = (("soap", "statistics_dtype", "float32"), ("kfac", "refresh_steps", 3))
    chosen = Layout(WORKLOADS["gpt2-tiny"], "1f1b", 4, 32, "adamw", 5, 10, settings=settings)
    assert chosen.config("soap").curvature.statistics_dtype == "float32"
    assert chosen.config("soap+helpers").curvature.statistics_dtype == "float32"
    assert chosen.config("kfac").curvature.refresh_steps == 3 and chosen.config(None).curvature is None


def test_a_round_is_quiet_for_a_pair_when_both_its_blocks_were():
    pair = Pair(
        "1f1b", "kfac", "K-FAC", 5, 0.15, [100.0, 100.0, 100.0], [101.0, 110.0, 102.0], [0.1, 0.1, 0.9], [0.0, 0.5, 0.1]
    )
    assert pair.ratios == pytest.approx([1.01, 1.10, 1.02])
    assert pair.quiet_ratios == pytest.approx([1.01])
    summary = pair.as_dict()
    assert summary["quiet"]["rounds"] == 1 and summary["quiet"]["ci95"] is None
    assert summary["all"]["ratio_median"] == pytest.approx(1.02)


def test_the_interval_is_students_t_on_the_log_ratios():
    interval = log_ratio_interval([math.exp(0.1), math.exp(0.3)])
    assert interval.centre == pytest.approx(math.exp(0.2))
    # sd of (0.1, 0.3) is 0.1414, its standard error 0.1; t(0.975, 1) = 12.706
    assert (interval.low, interval.high) == pytest.approx((math.exp(0.2 - 1.2706), math.exp(0.2 + 1.2706)))
    assert log_ratio_interval([1.02]) is None
    assert t_975(4) == 2.776 and t_975(30) == 2.042 and t_975(1000) == 1.96


def test_rounds_of_several_process_groups_are_summarised_per_group():
    # group 0 sits 2 % above group 1 throughout: the rounds' spread alone would hide it
    groups = [
        Pair("1f1b", "kfac", "K-FAC", 5, 0.15, [100.0] * 3, [103.0, 103.1, 102.9], [0.0] * 3, [0.0] * 3, 0.01),
        Pair("1f1b", "kfac", "K-FAC", 6, 0.15, [100.0] * 3, [101.0, 101.1, 100.9], [0.0, 0.9, 0.0], [0.0] * 3, 0.02),
    ]
    pair = Pair.merged(groups)
    assert pair.groups == [0, 0, 0, 1, 1, 1] and pair.group_ks == [5, 6] and pair.group_estimates == [0.01, 0.02]
    assert pair.quiet_groups == [0, 0, 0, 1, 1]
    means = [math.exp(statistics.fmean(math.log(r) for r in g.ratios)) for g in groups]
    assert pair.interval == log_ratio_interval(means)
    assert grouped_interval(pair.ratios, pair.groups) == log_ratio_interval(means)
    pooled = log_ratio_interval(pair.ratios)
    assert pair.interval.high - pair.interval.low > 5 * (pooled.high - pooled.low)
    assert grouped_interval(groups[0].ratios, [0, 0, 0]) == log_ratio_interval(groups[0].ratios)
    assert pair.as_dict()["all"]["ci95"] == [pair.interval.low, pair.interval.high]
    row = cells(ratio_table([pair]), "| 1f1b | K-FAC |")
    assert row[2] == "5, 6" and row[-2] == "+1.0 %, +2.0 %" and row[-1] == "+3.0 %, +1.0 %"
    assert "95 % CI over groups" in ratio_table([pair])
    assert "over groups" not in ratio_table(groups[:1]) and len(cells(ratio_table(groups[:1]), "| 1f1b |")) == 11
