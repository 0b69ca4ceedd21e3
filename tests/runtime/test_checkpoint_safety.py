"""Nothing a run does loses a checkpoint: one writer per folder, and retention that keeps only
checkpoints that verify (real `pipefisher run`s of schedules/tiny-regression.yaml)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipefisher.config import load_config
from pipefisher.runtime.training.checkpoint import CheckpointError, step_folder
from pipefisher.runtime.training.resumption import resumable_step

RUN_FILE = str(Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml")


def pipefisher(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["pipefisher", *args], capture_output=True, text=True, timeout=120)


def run(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return pipefisher("run", RUN_FILE, "--checkpoint-dir", str(directory), "--master-port", "0", *args)


def steps(directory: Path) -> list[int]:
    return sorted(int(path.name[len("step-") :]) for path in directory.glob("step-*"))


def test_a_second_run_on_a_folder_in_use_stops_in_one_line_and_a_dead_holder_blocks_nothing(tmp_path):
    directory = tmp_path / "checkpoints"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom pipefisher.runtime.training.checkpoint_lock import hold_checkpoint_folder\n"
            f"with hold_checkpoint_folder({str(directory)!r}):\n    print('held', flush=True)\n    time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        refused = run(directory, "--steps", "1", "--optimizer.lr", "0.01")
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith(
            f"pipefisher: error: checkpoint.dir {directory} is in use by another run (pid {holder.pid} on "
        )
        assert refused.stderr.rstrip().endswith("); wait for it to end or give another --checkpoint-dir")
        assert steps(directory) == []
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # the OS releases the lock; its file stays, naming a dead process
        holder.wait()
    assert (directory / ".lock").exists()
    after = run(directory, "--steps", "1")
    assert after.returncode == 0, after.stderr
    assert steps(directory) == [1]


def test_retention_keeps_the_good_step_a_fallback_skipped_past(tmp_path):
    """Issue 41: steps 3 and 4 kept (keep 2); step 4's rank file truncated; --resume falls back to 3
    and the run writes 6: step 3 stays, step 4 is moved aside, never kept in place of 3."""
    directory = tmp_path / "checkpoints"
    first = run(directory, "--steps", "4", "--checkpoint.every", "3", "--checkpoint.keep", "2")
    assert first.returncode == 0, first.stderr
    assert steps(directory) == [3, 4]
    rank_file = step_folder(directory, 4) / "rank-1.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-100])
    resumed = run(directory, "--steps", "6", "--checkpoint.every", "3", "--checkpoint.keep", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "pipefisher: resuming from step 3, the newest checkpoint that verifies" in resumed.stderr
    assert steps(directory) == [3, 6]
    moved = directory / "corrupt-step-000004"
    assert (moved / "rank-1.pt").exists()
    assert f"pipefisher: checkpoint step 4 does not verify ({rank_file}: " in resumed.stderr
    assert f"moved to {moved}" in resumed.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of tiny-regression at step 2 (1f1b, 2 stages × 1 replica × 4 micro-batches, sgd lr 0.05)."""
    directory = tmp_path_factory.mktemp("advice") / "checkpoints"
    first = run(directory, "--steps", "2")
    assert first.returncode == 0, first.stderr
    return directory


def advice(message: str) -> dict[str, dict[str, object]]:
    """The keys a refusal says to set ("set a.b: 1, c.d: x to resume it"), as with_overrides takes them."""
    found = re.search(r"; set (.+) to resume it$", message)
    assert found, message
    sections: dict[str, dict[str, object]] = {}
    for pair in found.group(1).split(", "):
        key, _, value = pair.partition(": ")
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = yaml.safe_load(value)
    return sections


@pytest.mark.parametrize(
    "change, said",
    [
        (
            {"pipeline": {"data_parallel": 2}},
            "the checkpoint's step takes 4 micro-batches (pipeline.micro_batches 4 × pipeline.data_parallel 1); "
            "here 8 (pipeline.micro_batches 4 × pipeline.data_parallel 2); set pipeline.micro_batches: 2 to resume it",
        ),
        ({"pipeline": {"data_parallel": 3}}, "set pipeline.micro_batches: 4, pipeline.data_parallel: 1 to resume it"),
        (
            {"pipeline": {"schedule": "chimera", "data_parallel": 4}},
            "set pipeline.micro_batches: 4, pipeline.data_parallel: 1 to resume it",
        ),
        ({"optimizer": {"lr": 0.01}}, "optimizer.lr is 0.05 there and 0.01 here; set optimizer.lr: 0.05 to resume it"),
        (
            {"optimizer": {"name": "kfac"}},
            "optimizer.name is sgd there and kfac here; set optimizer.name: sgd to resume it",
        ),
        ({"model": {"hidden": 16, "ffn": 32}}, "set model.ffn: 64, model.hidden: 32 to resume it"),
    ],
)
def test_every_advice_to_resume_names_keys_that_resume(checkpoint, change, said):
    """The refusal names keys that exist, with values that make `resumable_step` take the step."""
    config = load_config(RUN_FILE).with_overrides(checkpoint={"dir": str(checkpoint)}, **change)
    with pytest.raises(CheckpointError) as refused:
        resumable_step(checkpoint, config)
    message = str(refused.value)
    assert "\n" not in message and message.endswith(said), message
    assert resumable_step(checkpoint, config.with_overrides(**advice(message))) == (2, [])


def test_the_cli_follows_its_own_advice_and_resumes(checkpoint):
    """`--data-parallel 2` changes the step's batch: the one line says which key to set; the run
    given that key on the command line resumes."""
    refused = run(checkpoint, "--steps", "3", "--resume", "--data-parallel", "2")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    flags = [
        part
        for section, values in advice(refused.stderr.strip()).items()
        for name, value in values.items()
        for part in (f"--{section}.{name}", str(value))
    ]
    assert flags == ["--pipeline.micro_batches", "2"]
    resumed = run(checkpoint, "--steps", "3", "--resume", "--data-parallel", "2", *flags)
    assert resumed.returncode == 0, resumed.stderr
    assert (
        "pipefisher: resuming from step 2, written on 1f1b, 2 stages × 1 replica × 4 micro-batches, on another layout"
        in resumed.stderr
    )


def test_a_checkpoint_of_another_model_is_said_as_a_whole(checkpoint):
    config = load_config(RUN_FILE).with_overrides(model={"kind": "mlp"})
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"the checkpoint in {checkpoint} is of another model (transformer: 4 blocks of width 32, synthetic data there; "
            "mlp: 4 blocks of width 32, synthetic data here); resume it with its own run file or give another --checkpoint-dir"
        ),
    ):
        resumable_step(checkpoint, config)
