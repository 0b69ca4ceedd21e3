"""Mixed precision: bf16 and fp16 pipelines equal their single-process references; fp16's overflow
skips a step on every rank alike; bf16 tracks fp32 on the BERT demo."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from _workers import pipelined_with_records
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


def assert_close_training(results, reference, rtol):
    for result in results:
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=rtol, atol=0)
        for key, value in result.parameters.items():
            name = key.split(".", 1)[1] if key.startswith("p1.") else key
            torch.testing.assert_close(value, reference.parameters[name], rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_bf16_pipeline_equals_the_bf16_reference(schedule, tiny_config):
    config = tiny_config(schedule=schedule).with_overrides(run={"precision": "bf16"}, optimizer={"clip_norm": 0.5})
    runs = run_group(pipelined_with_records, 2, args=(config,), timeout=30, deadline=120)
    reference = train_reference(config)
    assert_close_training([result for result, _ in runs], reference, rtol=1e-4)
    fp32 = train_reference(tiny_config(schedule=schedule).with_overrides(optimizer={"clip_norm": 0.5}))
    assert reference.losses != fp32.losses, "bf16 computes in bf16"
    assert reference.losses[-1] == pytest.approx(fp32.losses[-1], rel=0.05)


def test_fp16_overflow_skips_the_step_on_every_rank_alike(tiny_config):
    """A loss scale of 2^20 overflows fp16 gradients: the first steps are skipped on every rank
    (the scale halves each time) until the scale fits; training then equals the reference."""
    config = tiny_config(schedule="1f1b").with_overrides(
        run={"precision": "fp16", "loss_scale": 2.0**20, "steps": 5}, optimizer={"clip_norm": 1.0}
    )
    runs = run_group(pipelined_with_records, 2, args=(config,), timeout=30, deadline=120)
    overflows = [[record["overflow"] for record in records] for _, records in runs]
    assert overflows[0] == overflows[1], "every rank decides the same"
    assert overflows[0][0] and not overflows[0][-1], overflows[0]
    reference = train_reference(config)
    assert_close_training([result for result, _ in runs], reference, rtol=1e-4)
    from pipefisher.runtime.training.assembly import staged_model

    initial = {
        f"{index}.{name}": p
        for index in range(2)
        for name, p in staged_model(config).build_stage(index, 2, 0).named_parameters()
    }
    first_kept = overflows[0].index(False)
    assert first_kept >= 1
    single_step = train_reference(config.with_overrides(run={"steps": first_kept}))
    for name, value in single_step.parameters.items():
        assert torch.equal(value, initial[name].detach()), "skipped steps leave the model unchanged"


@pytest.mark.slow
def test_bf16_tracks_fp32_on_the_bert_demo(tmp_path):
    losses = {}
    for precision in ("fp32", "bf16"):
        result = subprocess.run(
            [
                "pipefisher",
                "run",
                str(ROOT / "schedules" / "tiny-cpu.yaml"),
                "--steps",
                "12",
                "--precision",
                precision,
                "--data.micro_batch_size",  # bf16 matmuls are ~7x slower than fp32 on a CPU
                "2",
                "--json",
                "--master-port",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**__import__("os").environ, "PIPEFISHER_CACHE": str(tmp_path)},
        )
        assert result.returncode == 0, result.stderr
        losses[precision] = [json.loads(line)["loss"] for line in result.stdout.splitlines()]
    assert len(losses["bf16"]) == 12
    assert losses["bf16"][-1] == pytest.approx(losses["fp32"][-1], rel=0.05)
    assert losses["bf16"] != losses["fp32"]
