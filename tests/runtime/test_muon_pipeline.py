"""Muon on the executor beyond the sweeps (test_curvature_equivalence.py runs its shipped defaults
on every schedule, with two data-parallel copies too): fp16's loss scale and overflow skips with
clipping on both paths (the P op of an unreplicated stage, the shares of a replicated one),
clipping's rule, a resume in the middle of a cycle, and a profile that times its matrices."""

import math
from pathlib import Path

import pytest
import torch

from _workers import assert_resumes_bit_for_bit, pipelined_with_records, profiled_by_the_cli
from builders import tiny_model, rules_of
from pipefisher.config import ConfigError, config_from_dict
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference
from pipefisher.schedules import get_schedule
from sweeps import pipeline

pytestmark = pytest.mark.dist
TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"


def muon_config(schedule="1f1b", data_parallel=1, run=None, **muon):
    """Two ranks (four with two copies) of the 4-block transformer, in-order mode, Muon at lr 0.02
    with weight decay and clipping, 5 steps."""
    return config_from_dict(
        {
            "model": tiny_model(),
            "data": {"micro_batch_size": 2},
            "pipeline": pipeline(schedule, data_parallel=data_parallel),
            "optimizer": {"name": "muon", "lr": 0.02, "weight_decay": 0.1, "clip_norm": 0.5},
            "muon": muon,
            "run": {"steps": 5, "timeout": 30, "master_port": 0, "in_order": True, **(run or {})},
        }
    )


@pytest.mark.parametrize("data_parallel, placement", [(1, "after-step"), (2, "packed")])
def test_fp16_overflows_leave_muon_as_it_was_and_the_run_equals_the_reference(data_parallel, placement):
    """A loss scale of 2^20 overflows the first steps: every rank skips them alike, the momentum
    keeps no trace of their infinite gradients (else every later update would be NaN), and the
    run equals its reference; one copy orthogonalises in the P op (here at the end of the step's
    work; the sweeps run it packed), two share the matrices."""
    config = muon_config(
        data_parallel=data_parallel, run={"precision": "fp16", "loss_scale": 2.0**20}, placement=placement
    )
    runs = run_group(pipelined_with_records, config.world_size, args=(config,), timeout=30, deadline=180)
    overflows = [[record["overflow"] for record in records] for _, records in runs]
    assert all(flags == overflows[0] for flags in overflows) and overflows[0][0] and not overflows[0][-1], overflows
    reference = train_reference(config)
    assert all(math.isfinite(loss) for loss in reference.losses)
    for result, _ in runs:
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-4, atol=0)
        for name, value in result.parameters.items():
            assert torch.isfinite(value).all(), name
            torch.testing.assert_close(value, reference.parameters[name], rtol=1e-4, atol=1e-6)


def test_muons_matrices_step_with_the_unclipped_gradient_and_count_in_the_norm():
    """One step with a tight clip and one without: Muon's matrices move alike (their update is
    orthogonalised from the unclipped gradient), the first-order parameters do not."""
    clipped = train_reference(muon_config(run={"steps": 1}).with_overrides(optimizer={"clip_norm": 1e-3}))
    free = train_reference(muon_config(run={"steps": 1}).with_overrides(optimizer={"clip_norm": 0.0}))
    matrices = [name for name in free.parameters if name.endswith("weight") and free.parameters[name].dim() == 2]
    assert matrices and all(torch.equal(clipped.parameters[name], free.parameters[name]) for name in matrices)
    rest = [name for name in free.parameters if name.endswith("bias")]
    assert any(not torch.equal(clipped.parameters[name], free.parameters[name]) for name in rest)


def test_muon_resumes_mid_cycle_bit_for_bit_with_each_replica_holding_its_share(tmp_path):
    """Chimera's two pipes share every stage: each rank keeps the momentum of the matrices it
    orthogonalises; a run stopped after step 2 of a 3-step cycle and resumed equals the straight run."""
    assert_resumes_bit_for_bit(muon_config("chimera", refresh_steps=3, run={"steps": 4}), 2, tmp_path)


def test_bad_muon_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"^muon.split: false is not possible"):
        muon_config(split=False)
    with pytest.raises(ConfigError, match=r"^muon.momentum: 1 must be in \[0, 1\)"):
        muon_config(momentum=1.0)
    assert not config_from_dict({"optimizer": {"name": "sgd"}, "muon": {"split": False}}).muon.split, (
        "another optimizer's run: not checked"
    )


def test_profile_of_a_muon_run_times_its_matrices_and_packs_them_into_the_drain(tmp_path):
    """The measured per-matrix times are the P op's; on 1F1B's two stages the first stage's P op
    lengthens rank 0's step by all of its time, the last stage's lies (mostly) in its drain bubble
    (measured times: rank 1's end of step may be the first-order step's end)."""
    profile, _ = profiled_by_the_cli(TINY, tmp_path, "muon")
    assert profile.method == "muon"
    names = [layer.name for layer in profile.stages[0].layers]
    assert "embed.weight" in names and not any(name.endswith("bias") or "norm" in name for name in names)
    assert all(
        layer.precondition > 0 and layer.time("refresh", 0) == layer.time("curvature", 0) == 0
        for stage in profile.stages
        for layer in stage.layers
    )
    packing = pack(get_schedule("1f1b", 2, 4), profile, rules_of(profile), PackOptions(percentile=None))
    first, last = (sum(layer.precondition for layer in stage.layers) for stage in profile.stages)
    plain, step = packing.first_order, packing.first_order.step_time
    rank0_end = plain.tail_start(0) + plain.tail(0)  # the step's end unless rank 1's measured end was later
    assert packing.refresh_steps == 1 and rank0_end + first - 1e-9 <= packing.cycle_time < step + first + 0.5 * last
