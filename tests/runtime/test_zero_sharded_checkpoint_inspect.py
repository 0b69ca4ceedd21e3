"""`pipefisher checkpoint inspect` shows the ZeRO degree a checkpoint was written with (its
manifest's `optimizer.zero`): a ZeRO-3 run's, and an old checkpoint's, written before or without
the key, still read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _workers import checkpointing
from _zero_runs import zero_config

from pipefisher.cli.main import main
from pipefisher.runtime.training.checkpoint import MANIFEST, step_folder
from pipefisher.runtime.training.launch import run_group

WRITTEN = Path(__file__).resolve().parents[1] / "fixtures" / "written_at_5fbc261" / "checkpoint"


def _inspect(directory: Path, capsys, *flags: str) -> tuple[int, str]:
    code = main(["checkpoint", "inspect", str(directory), *flags])
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_a_zero3_checkpoint_shows_its_degree(tmp_path, capsys):
    directory = tmp_path / "checkpoints"
    config = zero_config("1f1b", 3, stages=1, run={"steps": 2}, checkpoint={"dir": str(directory), "every": 2})
    run_group(checkpointing, config.world_size, args=(config, False), timeout=30, deadline=240)
    code, text = _inspect(directory, capsys)
    assert code == 0, text
    lines = text.splitlines()
    assert lines[0] == f"checkpoint {step_folder(directory, 2)}: step 2"
    assert lines[2].startswith("layout:   1f1b, 1 stage × 2 replicas × 4 micro-batches, ZeRO-3;")
    assert lines[-2] == (
        "zero:     ZeRO-3 (optimizer.zero 3: parameters, gradients and optimizer state (FSDP2) sharded over each "
        "stage's 2 replicas while training); saved whole: any optimizer.zero resumes it"
    )
    assert lines[-1].startswith("verifies: yes")
    code, text = _inspect(directory, capsys, "--json")
    assert code == 0 and json.loads(text)["zero"] == 3


def test_old_checkpoints_still_read(tmp_path, capsys):
    code, text = _inspect(WRITTEN, capsys)
    assert code == 0 and "zero:     ZeRO-0 (optimizer.zero 0: nothing sharded)" in text.splitlines()
    unrecorded = tmp_path / "checkpoint"
    shutil.copytree(WRITTEN, unrecorded)
    manifest_path = step_folder(unrecorded, 2) / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    del manifest["layout"]["optimizer.zero"]
    manifest_path.write_text(json.dumps(manifest))
    code, text = _inspect(unrecorded, capsys)
    assert code == 0, text
    assert "zero:     not recorded (written before checkpoints recorded optimizer.zero): as 0" in text.splitlines()
    code, text = _inspect(unrecorded, capsys, "--json")
    assert code == 0 and json.loads(text)["zero"] is None
