"""Nothing a run does loses a checkpoint: one writer per folder, and retention that keeps only
checkpoints that verify (real `pipefisher run`s of schedules/tiny-regression.yaml)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pipefisher.runtime.training.checkpoint import step_folder

RUN_FILE = str(Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml")


def pipefisher(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["pipefisher", *args], capture_output=True, text=True, timeout=120)


def run(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return pipefisher("run", RUN_FILE, "--checkpoint-dir", str(directory), "--master-port", "0", *args)


def steps(directory: Path) -> list[int]:
    return sorted(int(path.name[len("step-"):]) for path in directory.glob("step-*"))


def test_a_second_run_on_a_folder_in_use_stops_in_one_line_and_a_dead_holder_blocks_nothing(tmp_path):
    directory = tmp_path / "checkpoints"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pipefisher.runtime.training.checkpoint_lock import hold_checkpoint_folder\n"
                               f"with hold_checkpoint_folder({str(directory)!r}):\n    print('held', flush=True)\n    time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        refused = run(directory, "--steps", "1", "--optimizer.lr", "0.01")
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith(f"pipefisher: error: checkpoint.dir {directory} is in use by another run (pid {holder.pid} on ")
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
