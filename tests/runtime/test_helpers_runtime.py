"""Help ops on the executor (`<method>.helpers`): layers of a stage preconditioned on another rank
(Muon: its matrices' orthogonalisation; K-FAC: ``B⁻¹ G A⁻¹`` with the inverses sent once per
cycle; Shampoo: a matrix's products with its roots, sent once per cycle; SOAP: a matrix's gradient
rotated into its eigenbases, sent once per cycle), their inputs and results over the ("help", owner, helper) communicator, equal to the
single-process reference in the in-order gloo mode (NCCL's rule), on the schedules whose stages
each have a precondition op of their own."""

import pytest
import torch

from _workers import pipelined_with_records, unit_profile
from test_curvature_equivalence import PARAMETER_ATOL, STEPS, shipped_defaults
from pipefisher.core.ir import Op, OpKind
from pipefisher.methods.blocks import FACTORS, MatrixInfo
from pipefisher.methods.layers import linear_info
from pipefisher.methods.registry import task_rules
from pipefisher.runtime.training.assembly import staged_model
from pipefisher.planning.comm.volume import ring_bytes
from pipefisher.planning.packing.helpers import helped_layers, with_help
from pipefisher.planning.packing.pack import after_step_plan
from pipefisher.planning.plan import validate_plan
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.pipefisher_run import stage_layer_names
from pipefisher.runtime.training.reference import train_reference
from pipefisher.schedules import get_schedule
from pipefisher.testing.harness import RTOL

pytestmark = pytest.mark.dist


def helped_plan(config, method: str, schedule_name: str, stage: int, helper: int, count: int):
    """The after-step plan of `config`'s 2-stage `schedule_name` (its refresh interval) with the
    first `count` layers of `stage` (the largest-first order does not matter here) helped by rank
    `helper`."""
    schedule = get_schedule(schedule_name, 2, 4)
    steps = config.section(method).refresh_steps or 1
    plan = after_step_plan(schedule, unit_profile(config, 2), task_rules(method), steps)
    for name in stage_layer_names(config, stage, 2)[:count]:
        plan = with_help(plan, Op(OpKind.HELP, stage, None, 0, name), helper)
    return validate_plan(plan)


def help_bytes(config, method: str, stage: int, names: list[str], step: int) -> int:
    """What each rank of the pair counts as sent on the help communicator in `step`: both ways
    of each layer's input and result, and K-FAC's inverses and flags in a cycle's first step (a
    broadcast over two ranks counts half its bytes, `ring_bytes`)."""
    with torch.device("meta"):
        module = staged_model(config).build_stage(stage, 2, config.run.seed)
    total = 0
    for name in names:
        if method in ("muon", "shampoo", "soap"):
            total += 2 * 4 * module.get_parameter(name).numel()
        section = config.section(method)
        if method in ("shampoo", "soap") and step % section.refresh_steps == 0:
            info = MatrixInfo.of(name, tuple(module.get_parameter(name).shape), section.block_size)
            total += 4 * sum(info.statistic_numel(factor) for factor in FACTORS)
        if method != "kfac":
            continue
        info = linear_info(name, module.get_submodule(name))
        total += 2 * 4 * info.b_size * info.a_size
        if step % config.kfac.refresh_steps == 0:
            total += 4 * (info.b_size**2 + info.a_size**2) + 2
    return ring_bytes("broadcast", total, 2)


@pytest.mark.parametrize(
    "method, schedule, stage, helper",
    [
        ("muon", "1f1b", 0, 1),
        ("muon", "zb-h1", 1, 0),
        ("kfac", "1f1b", 0, 1),
        ("kfac", "zb-h1", 1, 0),
        ("shampoo", "1f1b", 0, 1),
        ("shampoo", "zb-h1", 1, 0),
        ("soap", "1f1b", 0, 1),
        ("soap", "zb-h1", 1, 0),
    ],
)
def test_helped_layers_train_as_the_reference(method, schedule, stage, helper, tmp_path):
    """Three layers of one stage preconditioned by the other rank, the sweeps' run of the method
    (`test_curvature_equivalence.shipped_defaults`; K-FAC's three cycles of two steps, the first
    preconditioning with the identity): every step's loss and every parameter equal the
    reference's at the sweeps' tolerances, and both ranks sent the layers' inputs and results
    (and K-FAC's inverses in each cycle's first step) on the help communicator."""
    config = shipped_defaults(method, schedule)
    plan = helped_plan(config, method, schedule, stage, helper, 3)
    path = tmp_path / "plan.json"
    plan.save(path)
    helped = config.with_overrides(**{method: {"plan": str(path), "helpers": True}})
    runs = run_group(pipelined_with_records, helped.world_size, args=(helped,), timeout=30, deadline=240)
    reference = train_reference(config)
    names = [name for name, _ in helped_layers(plan)[(0, stage)]]
    expected = [help_bytes(config, method, stage, names, step) for step in range(STEPS)]
    for result, records in runs:
        assert [record.get("help_comm_bytes") for record in records] == expected
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=RTOL, atol=0)
        for name, value in result.parameters.items():
            torch.testing.assert_close(value, reference.parameters[name], rtol=RTOL, atol=PARAMETER_ATOL)


@pytest.mark.parametrize("method", ["shampoo", "soap"])
def test_a_plan_without_p_ops_runs_with_helpers_on(method, tmp_path):
    """Where the packer left a method's optional P ops out (`pack_choosing_p_ops`: no help op pays),
    a run with `helpers: true` takes the plan (its check asks for no P ops then) and its step end
    does their work: every loss and parameter equal the reference's."""
    config = shipped_defaults(method, "1f1b")
    steps = config.section(method).refresh_steps or 1
    profile = unit_profile(config, 2)
    plan = after_step_plan(get_schedule("1f1b", 2, 4), profile, task_rules(method), steps, precondition=False)
    path = tmp_path / "plan.json"
    plan.save(path)
    helped = config.with_overrides(**{method: {"plan": str(path), "helpers": True}})
    runs = run_group(pipelined_with_records, helped.world_size, args=(helped,), timeout=30, deadline=240)
    reference = train_reference(config)
    for result, _ in runs:
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=RTOL, atol=0)
        for name, value in result.parameters.items():
            torch.testing.assert_close(value, reference.parameters[name], rtol=RTOL, atol=PARAMETER_ATOL)


@pytest.mark.parametrize("method", ["kfac", "shampoo", "soap"])
def test_helpers_resume_mid_cycle_bit_for_bit(method, tmp_path):
    """The helper holds the helped layers' inverses (K-FAC), roots (Shampoo) or bases (SOAP) for
    the cycle, sent in its first step only: a run stopped after step 4, one step into a cycle of
    three, resumes with them from the checkpoint's cycle state and ends bit for bit where the
    straight run does (SOAP, clipped: its stage's rank also knows which matrices it had bases of
    when sent, so it takes the same scaled rotations)."""
    from _workers import assert_resumes_bit_for_bit

    config = shipped_defaults(method, "1f1b", refresh_steps=3)
    if method == "soap":  # clipped between its P op and its step end: the held rotations are scaled
        config = config.with_overrides(optimizer={"clip_norm": 1e-3})
    path = tmp_path / "plan.json"
    helped_plan(config, method, "1f1b", 0, 1, 3).save(path)
    parted = assert_resumes_bit_for_bit(
        config.with_overrides(**{method: {"plan": str(path), "helpers": True}}), 4, tmp_path
    )
    ours, theirs = (last_checkpoint_tensors(folder) for folder in (parted, tmp_path / "straight"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in theirs)


def last_checkpoint_tensors(folder) -> dict:
    """Every tensor of every rank's file of the newest checkpoint in `folder`, by file and path
    (the method's state included: moments move where a rounding leaves the parameters alone)."""
    from pathlib import Path

    from pipefisher.runtime.training.checkpoint import steps

    _, newest = steps(Path(folder))[0]
    found = {}

    def walk(value, key):
        if isinstance(value, torch.Tensor):
            found[key] = value
        elif isinstance(value, dict):
            for name, item in value.items():
                walk(item, f"{key}/{name}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{key}/{index}")

    for path in sorted(newest.glob("rank-*.pt")):
        walk(torch.load(path, weights_only=False), path.name)
    return found


def promising_profile(config, folder):
    """The path of a profile of `config`'s run that says stage 0's layers take 1 s each and cross
    the link in 100 ms each way (204,800 bytes at 2,048 per ms): the packer hands some to rank 1;
    the run measures them at milliseconds, against the profile's 200 ms of transfers."""
    from dataclasses import replace

    profile = unit_profile(config, 2)
    slow = [replace(layer, precondition=1000.0, weight_bytes=204800) for layer in profile.stages[0].layers]
    stages = (replace(profile.stages[0], layers=tuple(slow), p2p=1.0, p2p_bytes=2048), profile.stages[1])
    path = folder / "profile.yaml"
    replace(profile, stages=stages).save(path)
    return str(path)


def test_a_run_packs_without_help_ops_its_own_op_times_say_do_not_pay(tmp_path):
    """A profile promises what help ops cannot give (`promising_profile`): the run measures that
    the transfers cost more than the help takes off (`exposed_helpers_gain_ms` < 0), and from the
    next cycle packs without help ops; losses and parameters stay the reference's."""
    config = shipped_defaults("muon", "1f1b")
    profile = promising_profile(config, tmp_path)
    helped = config.with_overrides(
        muon={"profile": profile, "helpers": True, "refresh_steps": 1, "reprofile_threshold": 1e9}
    )
    runs = run_group(pipelined_with_records, helped.world_size, args=(helped,), timeout=30, deadline=240)
    reference = train_reference(config)
    for result, records in runs:
        sent = [record.get("help_comm_bytes") for record in records]
        gains = [record["exposed_helpers_gain_ms"] for record in records if "exposed_helpers_gain_ms" in record]
        assert sent[0] and gains and gains[0] < 0, (sent, gains)
        assert sent[-1] is None, "packed without help ops once measured"
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=RTOL, atol=0)
        for name, value in result.parameters.items():
            torch.testing.assert_close(value, reference.parameters[name], rtol=RTOL, atol=PARAMETER_ATOL)


def test_a_run_that_dropped_its_help_ops_resumes_without_them(tmp_path):
    """K-FAC drops its help ops after its first measured cycle (steps 3-4); the checkpoint after
    step 5, one step into a cycle, says so, and the resumed run packs without them too (with
    them it would have no inverses on the helper for that cycle): bit for bit the straight run."""
    from _workers import assert_resumes_bit_for_bit

    config = shipped_defaults("kfac", "1f1b")
    profile = promising_profile(config, tmp_path)
    section = {"profile": profile, "helpers": True, "reprofile_threshold": 1e9}
    assert_resumes_bit_for_bit(config.with_overrides(kfac=section), 5, tmp_path)
