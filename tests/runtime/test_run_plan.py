"""`pipefisher run --plan`: a plan written by `pipefisher pack -o` runs as it is, after a check that
it fits the run; a plan of another run is refused naming the field, before any process starts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _workers import unit_profile
from pipefisher.methods.registry import task_rules
from pipefisher.cli.main import main
from pipefisher.config import load_config

TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A K-FAC profile of tiny-regression (made-up times) and plans packed from it with -o."""
    folder = tmp_path_factory.mktemp("plans")
    config = load_config(TINY).with_overrides(optimizer={"name": "kfac"})
    unit_profile(config, 2, inverse=3.0).save(folder / "profile.yaml")
    plans = {
        "1f1b": ["--schedule", "1f1b"],
        "gpipe": ["--schedule", "gpipe"],
        "n8": ["--schedule", "1f1b", "-N", "8"],
        "dp2": ["--schedule", "1f1b", "--data-parallel", "2"],
    }
    for name, args in plans.items():
        assert (
            main(
                [
                    "pack",
                    "--profile",
                    str(folder / "profile.yaml"),
                    "-D",
                    "2",
                    "-N",
                    "4",
                    *args,
                    "-o",
                    str(folder / f"{name}.json"),
                    "--json",
                ]
            )
            == 0
        )
    return folder


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipefisher", "run", str(TINY), "--master-port", "0", "--json", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.dist
def test_a_packed_plan_runs_as_it_is_and_trains_like_the_reference(packed):
    k = len(json.loads((packed / "1f1b.json").read_text())["steps"])
    plan = run(
        "--optimizer",
        "kfac",
        "--plan",
        str(packed / "1f1b.json"),
        "--profile",
        str(packed / "profile.yaml"),
        "--steps",
        "6",
    )
    assert plan.returncode == 0, plan.stderr
    assert f"K-FAC plan {packed / '1f1b.json'}: refresh every {k} steps" in plan.stderr
    reference = run("--optimizer", "kfac", "--reference", "--kfac-refresh-steps", str(k), "--steps", "6")
    assert reference.returncode == 0, reference.stderr
    losses = lambda result: [json.loads(line)["loss"] for line in result.stdout.splitlines()]
    assert losses(plan) == pytest.approx(losses(reference), rel=1e-5)


@pytest.mark.parametrize(
    "plan, args, message",
    [
        ("gpipe", [], "schedule: the plan is for gpipe, this run has 1f1b (pipeline.schedule)"),
        ("n8", [], "micro_batches: the plan is for 8, this run has 4 (pipeline.micro_batches)"),
        ("1f1b", ["--optimizer", "shampoo"], "method: the plan runs kfac tasks but this run uses shampoo"),
        ("1f1b", ["--data-parallel", "2"], "tasks: the plan's curvature tasks are not this layout's (data_parallel 2"),
        ("dp2", [], "tasks: the plan's curvature tasks are not this layout's (data_parallel 1"),
        ("1f1b", ["--optimizer", "sgd"], "a plan places a curvature method's work; this run's optimizer is sgd"),
        ("profile", [], "is a pipefisher profile file (pipefisher.profile/v2), not a plan"),
    ],
)
def test_a_plan_of_another_run_is_refused_naming_the_field(packed, capsys, plan, args, message):
    path = packed / (f"{plan}.yaml" if plan == "profile" else f"{plan}.json")
    assert main(["run", str(TINY), "--optimizer", "kfac", "--plan", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "schedule, data_parallel, method",
    [("chimera", 1, "shampoo"), ("chimera", 2, "kfac"), ("zbv", 2, "kfac"), ("interleaved", 2, "shampoo")],
)
def test_a_plan_packed_for_the_runs_own_layout_fits_it(tmp_path, schedule, data_parallel, method):
    """Where a stage has replicas the packer picks which one computes each inverse (or root) by
    the profile's times: the check compares those tasks without their replica."""
    from pipefisher.planning.plan import Plan
    from pipefisher.runtime.training.assembly import build_schedule
    from pipefisher.runtime.training.pipefisher_run import check_plan_matches

    config = load_config(TINY).with_overrides(
        optimizer={"name": method}, pipeline={"schedule": schedule, "data_parallel": data_parallel}
    )
    built = build_schedule(config)
    unit_profile(config, built.num_stages, inverse=3.0).save(tmp_path / "profile.yaml")
    assert (
        main(
            [
                "pack",
                "--profile",
                str(tmp_path / "profile.yaml"),
                "--schedule",
                schedule,
                "-D",
                "2",
                "-N",
                "4",
                "--data-parallel",
                str(data_parallel),
                "-o",
                str(tmp_path / "plan.json"),
                "--json",
            ]
        )
        == 0
    )
    check_plan_matches(Plan.load(tmp_path / "plan.json", task_rules), config, built)
