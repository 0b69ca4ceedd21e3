"""Tensor parallelism (pipeline.tensor_parallel): two processes per rank, each holding its shards
of every block, train exactly like the single-process reference that holds the shards side by
side, in the in-order mode (NCCL's rule on gloo, the tensor-parallel all-reduces included): first
order, and every curvature method preconditioning each shard's block, packed and after the step,
on 1F1B and Chimera; with data parallelism; on a Hugging Face Llama; and a resume is bit for bit.
"""

import json
import subprocess

import pytest
import torch

from _workers import assert_equal_to_reference, assert_resumes_bit_for_bit, pipelined
from pipefisher.config import ConfigError
from pipefisher.methods.registry import methods
from pipefisher.schedules import SCHEDULES
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference
from pipefisher.cli.training import tensor_parallel_placement
from test_curvature_equivalence import PARAMETER_ATOL, shipped_defaults
from test_run_cli import TINY

pytestmark = pytest.mark.dist


def tensor_parallel(method: str, schedule: str, optimizer: str | None = None, data_parallel: int = 1, **section):
    """`shipped_defaults` (2 stages of the 4-block transformer, in-order mode) split over 2
    tensor-parallel processes per rank, the global gradient norm clipped (its sum over shards)."""
    config = shipped_defaults(method, schedule, data_parallel, optimizer, **section)
    return config.with_overrides(pipeline={"tensor_parallel": 2}, optimizer={"clip_norm": 0.5})


#: first order on every schedule; K-FAC and Shampoo on 1F1B and Chimera, both placements; every
#: other method on 1F1B; recomputation (`model.recompute`, whose recomputed blocks all-reduce
#: again inside the backward): K-FAC packed (its capture skips the recomputed forward) recomputing
#: blocks on 1F1B, first order recomputing the attention cores under ZB-H1's split backward
FULL_SWEEP = ("kfac", "shampoo")
CASES = (
    [("adamw", schedule, None, "none") for schedule in SCHEDULES]
    + [
        (method, schedule, placement, "none")
        for method in FULL_SWEEP
        for schedule in ("1f1b", "chimera")
        for placement in ("packed", "after-step")
    ]
    + [(method, "1f1b", "packed", "none") for method in methods() if method not in FULL_SWEEP]
    + [("kfac", "1f1b", "packed", "blocks"), ("adamw", "zb-h1", None, "selective")]
)


@pytest.mark.parametrize("optimizer, schedule, placement, recompute", CASES)
def test_tensor_parallel_equals_the_reference(optimizer, schedule, placement, recompute):
    if placement is None:  # first order: 3 steps show it
        config = tensor_parallel("kfac", schedule, optimizer=optimizer).with_overrides(run={"steps": 3})
    else:
        config = tensor_parallel(optimizer, schedule, placement=placement)
    assert_equal_to_reference(config.with_overrides(model={"recompute": recompute}), PARAMETER_ATOL)


@pytest.mark.parametrize("method", methods())
def test_each_shard_is_its_own_block(method):
    """Not vacuous: splitting changes nothing for a first-order optimizer, but a curvature method
    preconditions each shard's block, not the whole layer's."""

    def losses(degree: int, optimizer: str | None = None) -> list[float]:
        config = shipped_defaults(method, "1f1b", optimizer=optimizer).with_overrides(
            pipeline={"tensor_parallel": degree}
        )
        return train_reference(config).losses

    assert losses(2, "adamw") == pytest.approx(losses(1, "adamw"), rel=1e-6)
    assert losses(2) != pytest.approx(losses(1), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer, gradient_path",
    [
        ("kfac", {"optimizer": {"zero": 1}}),
        ("adamw", {"comm": {"powersgd_rank": 32}}),  # at the gradients' full rank: exact
    ],
)
def test_tensor_and_data_parallel_equal_the_reference(optimizer, gradient_path):
    """Tensor x pipeline x data parallelism: 2 x 2 x 2 = 8 processes; K-FAC packed with ZeRO-1,
    and PowerSGD compressing each shard's gradient."""
    config = tensor_parallel("kfac", "1f1b", optimizer=None if optimizer == "kfac" else optimizer, data_parallel=2)
    assert_equal_to_reference(config.with_overrides(**gradient_path), PARAMETER_ATOL)


def test_bf16_tensor_parallel_equals_the_bf16_reference(tiny_config):
    """bf16 partial outputs summed over the processes track the reference's side-by-side shards to
    bf16's resolution: the input gradient of query, key and value is summed over their shards in
    another order than the reference's autograd sums it (fp32), and a last-bit difference flips
    the rounding of what is next cast to bf16 (one bf16 step is 0.4 %)."""
    config = tiny_config(schedule="1f1b", tensor_parallel=2).with_overrides(
        run={"precision": "bf16"}, optimizer={"clip_norm": 0.5}
    )
    reference = train_reference(config)
    for result in run_group(pipelined, config.world_size, args=(config,), timeout=30, deadline=120):
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=4e-3, atol=0)
        for key, value in result.parameters.items():
            torch.testing.assert_close(value, reference.parameters[key], rtol=4e-3, atol=1e-3)


def test_a_tensor_parallel_resume_is_bit_for_bit(tmp_path):
    assert_resumes_bit_for_bit(tensor_parallel("shampoo", "1f1b").with_overrides(run={"steps": 3}), 2, tmp_path)


def test_what_cannot_be_split_is_refused_in_one_line():
    base = shipped_defaults("kfac", "1f1b", optimizer="adamw")
    with pytest.raises(ConfigError, match=r"^pipeline.tensor_parallel: 3 does not divide model.heads 2"):
        base.with_overrides(pipeline={"tensor_parallel": 3})
    with pytest.raises(ConfigError, match=r"^pipeline.tensor_parallel: model.kind mlp has no tensor-parallel split"):
        base.with_overrides(model={"kind": "mlp"}, pipeline={"tensor_parallel": 2})
    with pytest.raises(ConfigError, match=r"^run.compile: tensor-parallel blocks"):
        base.with_overrides(pipeline={"tensor_parallel": 2}, run={"compile": True})


@pytest.mark.slow
def test_a_hugging_face_llama_splits_over_two_processes(tmp_path):
    """Llama's attention (grouped key/value heads) and gated MLP split over 2 processes, 2 stages,
    K-FAC on each shard: equal to the unsplit `transformers` model holding the shards side by side;
    the checkpoint's shards join into the unsplit model's state dict (what `pipefisher export` writes)."""
    pytest.importorskip("transformers")
    from pipefisher.runtime.training.export import merged_state_dict
    from test_hf_runs import assert_equals_the_unsplit_model, hf_run

    config = hf_run(
        str(tmp_path),
        "llama-tiny",
        pipeline={"tensor_parallel": 2},
        optimizer={"name": "kfac"},
        kfac={"refresh_steps": 2},
        checkpoint={"dir": str(tmp_path / "checkpoints")},
    )
    # lr 0.1 with momentum 0.9 and damped inverses amplify the rounding of the statistics' sums
    # (row shares summed over the shards, in another order than the reference's): up to 1.3e-5
    reference = assert_equals_the_unsplit_model(config, parameter_atol=5e-5)
    merged = merged_state_dict(config, config.run.steps)
    assert merged.keys() >= reference.parameters.keys()
    for name, value in reference.parameters.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=5e-5)


def test_gpt2_is_refused_with_the_reason(tmp_path):
    pytest.importorskip("transformers")
    from pipefisher.runtime.training.assembly import staged_model
    from test_hf_runs import hf_run

    with pytest.raises(
        ConfigError, match=r"^model.hf_class: GPT-2 projects query, key and value with one fused Conv1D"
    ):
        staged_model(hf_run(str(tmp_path), "gpt2-tiny", pipeline={"tensor_parallel": 2}))


def test_a_ranks_processes_must_share_a_node():
    assert tensor_parallel_placement(2, 8) is None and tensor_parallel_placement(4, 4) is None
    assert tensor_parallel_placement(2, 3) == (
        "pipeline.tensor_parallel: the 2 processes of a rank all-reduce inside every forward and backward and must share a node; "
        "torchrun starts 3 per node: make --nproc-per-node a multiple of 2"
    )


@pytest.mark.slow
def test_torchrun_runs_the_tensor_parallel_flag_like_the_reference():
    """`--tensor-parallel 2` under torchrun (4 processes: 2 stages x 2 shards) and in one process."""

    def losses(*launcher: str, extra: tuple[str, ...] = ()) -> list[float]:
        result = subprocess.run(
            [*launcher, "run", str(TINY), "--tensor-parallel", "2", "--steps", "2", "--json", *extra],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return [json.loads(line)["loss"] for line in result.stdout.splitlines()]

    torchrun = losses("torchrun", "--standalone", "--nproc-per-node", "4", "-m", "pipefisher")
    assert torchrun == pytest.approx(losses("pipefisher", extra=("--reference",)), rel=1e-5)
