"""Files written by pipefisher at 5fbc261, before architecture v3 (tests/fixtures/written_at_5fbc261,
its README says how each was made), are read by today's code: a profile, a plan, and a format-2
checkpoint that resumes into the losses the old code's uninterrupted run had."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pipefisher.core.profile import load_profile
from pipefisher.planning.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
WRITTEN = ROOT / "tests" / "fixtures" / "written_at_5fbc261"
RUN = [
    str(ROOT / "schedules" / "tiny-regression.yaml"),
    "--model.hidden",
    "8",
    "--model.ffn",
    "16",
    "--model.input_dim",
    "4",
    "--optimizer",
    "kfac",
    "--master-port",
    "0",
]


def run(*args: str) -> list[dict]:
    """The steps a `pipefisher run` of the fixtures' run (with `args`) prints as JSON."""
    done = subprocess.run(["pipefisher", "run", *RUN, "--json", *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_the_profile_and_the_plan_load():
    profile = load_profile(WRITTEN / "profile.yaml")
    assert profile.method == "kfac" and len(profile.stages) == 2
    assert all(stage.layers for stage in profile.stages)
    plan = Plan.load(WRITTEN / "plan.json")
    assert plan.method == "kfac" and plan.schedule.num_ranks == 2 and plan.schedule.num_micro_batches == 4
    assert plan.curvature_ops()


def test_the_checkpoint_resumes_into_the_old_runs_losses(tmp_path):
    """Step 3 resumed today from the old step 2 equals step 3 of the old code's uninterrupted run;
    a fresh run today equals the old one at every step: bitwise on the kind of CPU that wrote the
    files, within float32 rounding on one whose kernels round differently (AVX-512 against AVX2)."""
    old = json.loads((WRITTEN / "losses.json").read_text())["losses"]
    folder = tmp_path / "checkpoint"
    shutil.copytree(WRITTEN / "checkpoint", folder)
    resumed = run("--kfac-refresh-steps", "2", "--steps", "3", "--checkpoint-dir", str(folder), "--resume")
    assert [row["step"] for row in resumed] == [3]
    fresh = run("--kfac-refresh-steps", "2", "--steps", "3")
    assert [row["loss"] for row in fresh] == pytest.approx(old, rel=1e-6, abs=0)
    assert resumed[0]["loss"] == pytest.approx(old[2], rel=1e-6, abs=0)


def test_the_plan_runs():
    steps = run("--steps", "1", "--plan", str(WRITTEN / "plan.json"))
    assert [row["refresh_steps"] for row in steps] == [Plan.load(WRITTEN / "plan.json").refresh_steps]
