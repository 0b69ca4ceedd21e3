"""experiments/plan_check.py: how one 2-stage profile becomes the other layouts' predictions
(replicated stages pay their gradient all-reduce, a 1-stage pipeline merges the stages), and bad
flags are one line and exit 2. The measured side (real runs, minutes) is the script's own job."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

from plan_check import Layout, ModelFacts, predict, with_replicas  # noqa: E402

from pipefisher.core.profile import Profile, StageProfile  # noqa: E402
from pipefisher.planning.simulate import simulate  # noqa: E402
from pipefisher.schedules import get_schedule  # noqa: E402

#: 1 MB boundary messages in 2 ms: 0.5 MB per ms
FACTS = ModelFacts(stage_parameter_bytes=(4_000_000, 2_000_000), model_parameter_bytes=5_000_000, boundary_bytes=1_000_000)
PROFILE = Profile((StageProfile(forward=10.0, backward=20.0, p2p=2.0, step_end=5.0),
                   StageProfile(forward=30.0, backward=50.0, step_end=7.0)))


def test_first_order_pipelines_are_the_simulated_step_of_the_profile():
    for schedule, micro_batches in [("1f1b", 4), ("gpipe", 8), ("zb-h1", 4)]:
        predicted, k = predict(Layout("bert-4x128", schedule, 2, micro_batches, "lamb"), PROFILE, FACTS)
        assert k == 1
        assert predicted == pytest.approx(simulate(get_schedule(schedule, 2, micro_batches), PROFILE).step_time)


def test_chimeras_pipes_all_reduce_each_stages_gradient_at_the_boundary_bandwidth():
    stages = with_replicas(PROFILE, Layout("bert-4x128", "chimera", 2, 4, "lamb"), FACTS).stages
    # a ring all-reduce over 2 ranks sends the whole buffer once per rank, at 0.5 MB per ms
    assert [stage.grad_reduce for stage in stages] == pytest.approx([8.0, 4.0])
    assert [stage.forward for stage in stages] == [10.0, 30.0]


def test_data_parallel_one_stage_pipelines_merge_the_stages_and_reduce_the_whole_model():
    (stage,) = with_replicas(PROFILE, Layout("bert-4x128", "1f1b", 1, 4, "lamb", data_parallel=2), FACTS).stages
    assert (stage.forward, stage.backward, stage.step_end, stage.p2p) == (40.0, 70.0, 12.0, 0.0)
    assert stage.grad_reduce == pytest.approx(10.0)
    predicted, _ = predict(Layout("bert-4x128", "1f1b", 1, 4, "lamb", data_parallel=2), PROFILE, FACTS)
    assert predicted == pytest.approx(4 * (40 + 70) + 10 + 12)


def test_a_bad_count_is_one_line_and_exit_2():
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "plan_check.py"), "--repeats", "0"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["plan_check: error: --repeats: 0 is not a positive count"]
