"""A method is a plugin: the diagonal method of `_diagonal_method`, defined and registered outside
the package, goes through the whole product without a line of the package naming it: its section
in the run file and its flags, pack -> plan -> the NCCL-order replay of every rank's issue order,
the profiler, the executor, and equality with its single-process reference on every schedule of
the registry (losses and parameters to rtol 1e-5, as the built-in methods)."""

import subprocess
from pathlib import Path

import pytest

from pipefisher.config import ConfigError, config_from_dict
from pipefisher.core.profile import LayerProfile, Profile, StageProfile
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import ActionKind
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.planning.plan import validate_plan
from pipefisher.schedules import SCHEDULES, get_schedule
from pipefisher.testing import assert_equal_to_reference, assert_not_vacuous
from builders import rules_of

PACKAGE = Path(__file__).resolve().parents[2] / "pipefisher"
PARAMETER_ATOL = 1e-5


@pytest.fixture
def diagonal():
    """The method, registered in this process for the test (spawned ranks import it themselves
    when they unpickle the run's config)."""
    import _diagonal_method

    with _diagonal_method.registered() as method:
        yield method


def diagonal_run(schedule: str, data_parallel: int = 1, **section):
    """Two ranks of a 4-block transformer, 4 micro-batches of 2, in-order mode, SGD at lr 0.01
    after the diagonal preconditioning, refreshed every 2 steps, 6 steps."""
    return config_from_dict(
        {
            "model": {"layers": 4, "hidden": 16, "heads": 2, "ffn": 32, "seq_len": 4, "input_dim": 8, "output_dim": 3},
            "data": {"micro_batch_size": 2},
            "pipeline": {"stages": 2, "micro_batches": 4, "schedule": schedule, "data_parallel": data_parallel},
            "optimizer": {"name": "diagonal", "lr": 0.01},
            "diagonal": {"refresh_steps": 2, **section},
            "run": {"steps": 6, "timeout": 30, "master_port": 0, "in_order": True},
        }
    )


def test_the_package_never_names_the_method():
    found = subprocess.run(
        ["grep", "-rli", "diagonal second-moment\\|_diagonal_method\\|DiagonalConfig", str(PACKAGE)],
        capture_output=True,
        text=True,
    )
    assert found.stdout == ""


def test_its_section_is_read_and_checked_like_a_built_in_one(diagonal):
    assert diagonal_run("1f1b", beta2=0.25).curvature.beta2 == 0.25
    with pytest.raises(ConfigError, match=r"diagonal.beta2: 1.5 must be in \[0, 1\)"):
        diagonal_run("1f1b", beta2=1.5)
    with pytest.raises(ConfigError, match="diagonal.damping: unknown key"):
        diagonal_run("1f1b", damping=0.1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_its_plans_replay_under_the_nccl_rule(diagonal, schedule):
    """One part per layer: one sync, one refresh and, between Chimera's pipes, one exchange."""
    pipeline = get_schedule(schedule, 4, 8)
    layers = tuple(LayerProfile(f"w{i}", refresh=(0.5,), sync=(0.1,)) for i in range(3))
    profile = Profile(stages=(StageProfile(1.0, 2.0, 0.05, layers=layers),) * pipeline.num_stages, method="diagonal")
    plan = pack(pipeline, profile, rules_of(profile), PackOptions(refresh_steps=2, data_parallel=2)).plan
    validate_plan(plan)
    assert plan.method == "diagonal"
    assert {op.token for op in plan.curvature_ops()} <= {"S0", "R0", "X"}
    comm = replay(plan_actions(Topology(pipeline, 2), plan, tied=False))
    launched = [a.target for step in comm.steps for actions in step for a in actions if a.kind is ActionKind.LAUNCH]
    synced = {c.key for c in launched if c.kind == "sync"}
    assert synced == {(stage, layer.name, 0) for stage in range(pipeline.num_stages) for layer in layers}, (
        "one sync per layer"
    )


@pytest.mark.dist
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_it_equals_its_reference_on_every_schedule(diagonal, schedule):
    assert_equal_to_reference(diagonal_run(schedule), PARAMETER_ATOL)


@pytest.mark.dist
def test_it_equals_its_reference_with_two_data_parallel_copies(diagonal):
    assert_equal_to_reference(diagonal_run("1f1b", data_parallel=2), PARAMETER_ATOL)


def test_it_changes_the_updates_from_its_second_cycle(diagonal):
    """Not vacuous: the scale of step 0 takes over at step 2."""
    assert_not_vacuous(diagonal_run("1f1b"), unchanged=3)
