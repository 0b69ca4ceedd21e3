"""SOAP on the executor: its plans have no syncs and replay under NCCL's rule; packed and
after-step runs compute the same bit for bit and equal the reference with split refresh work
(Chimera's exchanges); it resumes mid-cycle; profile, pack and viz serve it. The registry sweeps
(test_curvature_equivalence.py) hold it equal to the reference on every schedule, with two
data-parallel copies, in the NCCL-order mode."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from _workers import assert_equal_to_reference, assert_resumes_bit_for_bit, pipelined
from builders import layered_profile, tiny_model, rules_of
from pipefisher.config import config_from_dict
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import ActionKind
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.planning.plan import validate_plan
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference
from pipefisher.schedules import SCHEDULES, get_schedule
from sweeps import pipeline

TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"
#: the largest difference seen is 2.7e-6 (Chimera, value and output weights of the attention)
PARAMETER_ATOL = 1e-5


def soap_config(schedule, placement="packed", steps=6, **soap):
    """Two ranks of a 4-block transformer, in-order mode, clipping, refresh every 2 steps (the
    bases of cycle 1 in use from step 4), the published lr; SOAP's ε and the rest's AdamW ε 1e-3
    as in the equivalence sweep (gradients that are zero in exact arithmetic)."""
    return config_from_dict(
        {
            "model": tiny_model(),
            "data": {"micro_batch_size": 2},
            "pipeline": pipeline(schedule),
            "optimizer": {"name": "soap", "clip_norm": 1.0, "eps": 1e-3},
            "soap": {"refresh_steps": 2, "placement": placement, "epsilon": 1e-3, **soap},
            "run": {"steps": steps, "timeout": 30, "master_port": 0, "in_order": True},
        }
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_its_plans_have_no_syncs_and_replay_under_the_nccl_rule(schedule):
    """Two parts per layer refreshed in the bubbles, exchanged between Chimera's pipes; nothing
    synced, also with data-parallel copies (the statistics come from the reduced gradient); one
    fold per (pipe, stage) in every step."""
    pipe = get_schedule(schedule, 4, 8)
    profile = layered_profile(pipe.num_stages, method="soap", curvature=0.0)
    # no P op, as a run with data-parallel copies has (`SoapConfig.precondition_op`)
    options = PackOptions(refresh_steps=2, data_parallel=2, precondition=False)
    plan = pack(pipe, profile, rules_of(profile), options).plan
    validate_plan(plan)
    kinds = {op.token for op in plan.curvature_ops()}
    assert {"R0", "R1", "U"} <= kinds <= {"R0", "R1", "X", "U"}
    folds = [[sorted(map(str, (op for ops in step for op in ops if op.token == "U")))] for step in plan.steps]
    assert folds[0] == folds[-1] and len(folds[0][0]) == len(pipe.placement)
    actions = replay(plan_actions(Topology(pipe, 2), plan, tied=False))
    launched = {a.target.kind for step in actions.steps for rank in step for a in rank if a.kind is ActionKind.LAUNCH}
    assert "sync" not in launched and ("exchange" in launched) == (pipe.num_pipes > 1)


def test_task_rules_take_a_method_without_syncs_and_refuse_syncs_it_does_not_have():
    from pipefisher.methods.method import TaskRules, WorkLabels
    from pipefisher.methods.registry import task_rules

    two = WorkLabels(parts=("left", "right"))
    assert task_rules("soap").sync_for(0) is None and task_rules("soap").syncs == ()
    with pytest.raises(ValueError, match="names syncs of a method without any"):
        TaskRules(curvature=False, syncs=(), sync_of=((0, 0), (1, 0)), precondition=False, labels=two)
    with pytest.raises(ValueError, match="must name one sync of `syncs`"):
        TaskRules(curvature=False, syncs=(0,), sync_of=((0, 0), (1, 1)), precondition=False, labels=two)


@pytest.mark.dist
def test_packed_and_after_step_compute_the_same_and_equal_the_reference():
    """Placement changes when the refresh runs, never what it computes; Chimera splits it over
    its pipes. The same for the statistics folded in the next step's bubbles (`fold: bubbles`)."""
    runs = {}
    for placement, fold in (("packed", "step-end"), ("after-step", "step-end"), ("packed", "bubbles")):
        config = soap_config("chimera", placement, fold=fold)
        runs[placement, fold] = run_group(pipelined, config.world_size, args=(config,), timeout=30, deadline=180)
    for other in (("after-step", "step-end"), ("packed", "bubbles")):
        for packed, run in zip(runs["packed", "step-end"], runs[other]):
            assert packed.losses == run.losses
            assert all(torch.equal(value, run.parameters[key]) for key, value in packed.parameters.items())
    assert_equal_to_reference(soap_config("chimera", "after-step"), PARAMETER_ATOL)


def test_the_refresh_changes_the_updates():
    """Not vacuous: bases refreshed in cycle 1 and used from step 4 change the loss of step 5
    against bases never refreshed within the run."""
    refreshed = train_reference(soap_config("1f1b")).losses
    first_bases_only = train_reference(soap_config("1f1b", refresh_steps=6)).losses
    assert refreshed[:5] == pytest.approx(first_bases_only[:5], rel=1e-6)
    assert refreshed[5] != pytest.approx(first_bases_only[5], rel=1e-5)


@pytest.mark.dist
@pytest.mark.parametrize("fold", ["step-end", "bubbles"])
def test_soap_resumes_mid_cycle_bit_for_bit_with_exchanges_in_flight(tmp_path, fold):
    """Stopped after step 4, inside the second cycle of 3 (snapshot, pending bases; with the fold
    in the bubbles, a gradient held), resumed."""
    assert_resumes_bit_for_bit(soap_config("chimera", refresh_steps=3, fold=fold), 4, tmp_path)


@pytest.mark.dist
@pytest.mark.parametrize("helpers", [False, True])
def test_profile_times_its_refresh_and_step_end_and_pack_and_viz_show_them(tmp_path, helpers):
    """With the fold in the bubbles, each matrix's fold is timed as its `fold` (the U op's
    time); the directions are its part of the end of step (`method_step_end`); with helpers each
    matrix's rotation in is timed as its `precondition` (the P op's), and none without."""
    profile_path, run_file = tmp_path / "soap.yaml", tmp_path / "run.yaml"
    run_file.write_text(TINY.read_text() + f"\nsoap:\n  fold: bubbles\n  helpers: {str(helpers).lower()}\n")
    measured = subprocess.run(
        [
            "pipefisher",
            "profile",
            str(run_file),
            "-o",
            str(profile_path),
            "--master-port",
            "0",
            "--repeats",
            "2",
            "--optimizer",
            "soap",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert measured.returncode == 0, measured.stderr
    from pipefisher.core.profile import load_profile

    profile = load_profile(profile_path)
    layers = [layer for stage in profile.stages for layer in stage.layers]
    assert profile.method == "soap" and "embed.weight" in [layer.name for layer in profile.stages[0].layers]
    assert all(
        layer.time("refresh", 0) > 0
        and layer.time("refresh", 1) > 0
        and layer.time("curvature", 0) == layer.time("sync", 0) == 0
        and layer.time("fold") > 0
        and (layer.time("precondition") > 0) == helpers
        for layer in layers
    )
    # measured as a difference of medians (with and without the directions): timed, so only its
    # presence and its bounds are asserted, not that the machine's noise left it above 0
    assert all(
        "method_step_end" in stage.samples and 0 <= stage.method_step_end <= stage.step_end for stage in profile.stages
    ), "its directions"
    packed = subprocess.run(
        ["pipefisher", "pack", "--profile", str(profile_path), "--schedule", "1f1b", "-D", "2", "-N", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert packed.returncode == 0, packed.stderr
    report = json.loads(packed.stdout)
    assert report["method"] == "soap" and report["refresh_steps"] >= 1
    picture = tmp_path / "soap.txt"
    drawn = subprocess.run(
        [
            "pipefisher",
            "viz",
            "--schedule",
            "1f1b",
            "-D",
            "2",
            "-N",
            "4",
            "--profile",
            str(profile_path),
            "--curvature",
            "-o",
            str(picture),
            "--width",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert drawn.returncode == 0, drawn.stderr
    assert "refresh" in picture.read_text().lower()
