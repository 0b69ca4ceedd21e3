"""experiments/plan_check.py: its predictions are the planner's on one 2-stage profile (the
measured p2p sets the data-parallel bandwidth; with `--split-profile` a profile measured under
ZB-H1 times the split-backward layouts), and bad flags are one line and exit 2. The measured side
(real runs, minutes) is the script's own job."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.plan_check import Case, planner_context, predict_case
from pipefisher.core.profile import LayerProfile, Profile, StageProfile
from pipefisher.planning.simulate import simulate
from pipefisher.schedules import get_schedule

ROOT = Path(__file__).resolve().parents[2]


def layer(block: int) -> LayerProfile:
    return LayerProfile(
        f"encoder.layer.{block}.attention.self.query", curvature=(0.1, 0.1), refresh=(0.5, 0.5), precondition=0.05
    )


#: tiny-cpu's split: blocks 0-1 and 2-3; a 262,144-byte boundary message (8 x 64 x 128 fp32) in 2 ms
PROFILE = Profile(
    (
        StageProfile(forward=10.0, backward=20.0, p2p=2.0, step_end=5.0, layers=(layer(0), layer(1))),
        StageProfile(forward=30.0, backward=50.0, step_end=7.0, layers=(layer(2), layer(3))),
    ),
    micro_batch_size=8,
)
PATH = Path("bert.yaml")
ONE = [(PATH, PROFILE)]
#: the same model profiled under ZB-H1: each backward split into input and weight gradients, 20 % dearer
SPLIT = replace(
    PROFILE, stages=tuple(replace(s, backward=1.2 * s.backward, weight=0.4 * s.backward) for s in PROFILE.stages)
)


def test_first_order_pipelines_at_the_profiled_split_are_its_simulated_step():
    for schedule, micro_batches in [("1f1b", 4), ("gpipe", 8), ("zb-h1", 4)]:
        predicted, k = predict_case(Case("bert-4x128", schedule, 2, micro_batches, "lamb"), ONE)
        assert k == 1
        assert predicted == pytest.approx(simulate(get_schedule(schedule, 2, micro_batches), PROFILE).step_time)


def test_the_data_parallel_bandwidth_is_the_measured_boundary_transfers():
    context = planner_context(Case("bert-4x128", "1f1b", 1, 4, "lamb", data_parallel=2), ONE)
    assert context.dp_bandwidth_gbps == pytest.approx(8 * 64 * 128 * 4 / 2e-3 / 1e9)
    merged, _ = predict_case(Case("bert-4x128", "1f1b", 1, 4, "lamb", data_parallel=2), ONE)
    assert merged > 4 * (40 + 70) + 12, "one stage of both stages' work, plus its gradient all-reduce"


def test_a_curvature_method_is_packed_with_a_refresh_interval():
    predicted, k = predict_case(Case("bert-4x128", "1f1b", 2, 4, "kfac"), ONE)
    assert k >= 1 and predicted >= simulate(get_schedule("1f1b", 2, 4), PROFILE).step_time


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_split_backward_layouts_take_the_profile_measured_under_zb_h1(schedule: str):
    both = [(PATH, PROFILE), (Path("bert-zb-h1.yaml"), SPLIT)]
    predicted, _ = predict_case(Case("bert-4x128", schedule, 2, 4, "lamb"), both)
    taken = SPLIT if schedule == "zb-h1" else PROFILE
    assert predicted == pytest.approx(simulate(get_schedule(schedule, 2, 4), taken).step_time)


def test_a_bad_count_is_one_line_and_exit_2():
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "plan_check.py"), "--repeats", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["plan_check: error: --repeats: 0 is not a positive count"]


def test_an_uneven_split_is_predicted_on_the_profile_cut_by_block():
    """[3, 1]: block 2 moves to the first stage with its share of the second stage's time (a block
    of its flops against the second stage's blocks and heads), so the pipeline's pace changes."""
    from pipefisher.planning.planner.sources import resplit

    case = Case("bert-4x128", "1f1b", 2, 4, "lamb", stage_blocks=(3, 1))
    predicted, _ = predict_case(case, ONE)
    cut = resplit(PROFILE, 2, planner_context(case, ONE).sizes, (3, 1))
    assert [len(stage.layers) for stage in cut.stages] == [3, 1]
    assert predicted == pytest.approx(simulate(get_schedule("1f1b", 2, 4), cut).step_time)
    assert predicted < predict_case(replace(case, stage_blocks=()), ONE)[0]


def test_the_page_pairs_each_uneven_layout_with_its_even_twin():
    from dataclasses import asdict

    from experiments.plan_check import split_ratios

    even, uneven = (
        Case("gpt2-tiny", "1f1b", 2, 4, "adamw"),
        Case("gpt2-tiny", "1f1b", 2, 4, "adamw", stage_blocks=(3, 1)),
    )
    rows = [
        {"layout": asdict(even), "predicted_per_round_ms": [100.0, 110.0], "repeats_ms": [200.0, 220.0]},
        {"layout": asdict(uneven), "predicted_per_round_ms": [90.0, 88.0], "repeats_ms": [170.0, 198.0]},
    ]
    (line,) = [line for line in split_ratios(rows) if line.startswith("- ")]
    assert "blocks 3/1" in line and "predicted **0.850x**" in line and "measured **0.875x**" in line
    assert split_ratios(rows[:1]) == []
