"""Runs that survive faults: signals stop every rank after the same step with a checkpoint;
resume verifies checkpoints and falls back past a corrupt one; a dead rank fails the run honestly."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "schedules" / "tiny-regression.yaml"
TIMEOUT = 20


def run_file(tmp_path, **checkpoint) -> Path:
    """tiny-regression.yaml with a `checkpoint` section and a short run.timeout."""
    data = yaml.safe_load(TINY.read_text())
    data["checkpoint"] = {"dir": str(tmp_path / "ck"), **checkpoint}
    data["run"]["timeout"] = TIMEOUT
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def pipefisher(*args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(["pipefisher", *map(str, args)], capture_output=True, text=True, timeout=timeout)


def losses(result: subprocess.CompletedProcess) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in map(json.loads, result.stdout.splitlines())}


STRAIGHT_STEPS = 16


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, float]:
    """Step -> loss of one uninterrupted run of STRAIGHT_STEPS steps, which the stopped, resumed
    and restarted runs continue (the run file's SGD has a constant rate: a shorter run's losses
    are this one's first)."""
    config = run_file(tmp_path_factory.mktemp("straight"))
    result = pipefisher("run", config, "--steps", STRAIGHT_STEPS, "--json", "--master-port", 0)
    assert result.returncode == 0, result.stderr
    return losses(result)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """The checkpoint folder of a 4-step run checkpointing every 2 steps, keeping 2: copied by
    the tests that corrupt it."""
    config = run_file(tmp_path_factory.mktemp("four-steps"), every=2, keep=2)
    result = pipefisher("run", config, "--steps", 4, "--json", "--master-port", 0)
    assert result.returncode == 0, result.stderr
    return config.parent / "ck"


class Launched:
    """`pipefisher run ... --json` in its own session; step lines collected as they come."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(
            ["pipefisher", "run", *map(str, args), "--json", "--master-port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.steps: list[dict] = []
        self.reader = threading.Thread(
            target=lambda: self.steps.extend(json.loads(line) for line in self.proc.stdout), daemon=True
        )
        self.reader.start()

    def wait_for_step(self, step: int, limit: float = 120) -> None:
        end = time.monotonic() + limit
        while len(self.steps) < step:
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < end, "the run made no progress"
            time.sleep(0.05)

    def ranks(self) -> list[int]:
        """PIDs of the rank processes the launcher started: the children of its forkserver."""
        processes = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    status = (entry / "status").read_text()
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
                processes[int(entry.name)] = (parent, cmdline)
        servers = {
            pid for pid, (parent, cmdline) in processes.items() if parent == self.proc.pid and b"forkserver" in cmdline
        }
        return [pid for pid, (parent, _) in processes.items() if parent in servers]

    def finish(self, limit: float) -> tuple[int, str]:
        code = self.proc.wait(timeout=limit)
        self.reader.join(10)
        return code, self.proc.stderr.read()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") >= 0


@pytest.mark.parametrize("target", ["launcher", "rank 1"])
def test_sigterm_stops_every_rank_after_one_step_with_a_checkpoint_and_resume_continues(target, tmp_path, straight):
    config = run_file(tmp_path)
    run = Launched(config, "--steps", "2000")
    run.wait_for_step(3)
    ranks = run.ranks()
    assert len(ranks) == 2
    os.kill(run.proc.pid if target == "launcher" else ranks[1], signal.SIGTERM)
    start = time.monotonic()
    code, stderr = run.finish(limit=2 * TIMEOUT + 30)
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - start < TIMEOUT + 10
    assert all(gone(pid) for pid in ranks), "no rank outlives the launcher"
    stopped = [line for line in stderr.splitlines() if "stopped at step" in line]
    step = len(run.steps)
    assert stopped == [f"pipefisher: stopped at step {step} by SIGTERM; checkpoint step {step} in {tmp_path / 'ck'}"], (
        stderr
    )
    assert "Traceback" not in stderr and "final loss" not in stderr
    assert step + 3 <= STRAIGHT_STEPS
    resumed = pipefisher("run", config, "--resume", "--steps", step + 3, "--json", "--master-port", 0)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(resumed) == {s: loss for s, loss in straight.items() if step < s <= step + 3}


@pytest.mark.parametrize("mode", ["pipelined", "reference"])
def test_ctrl_c_says_one_line_and_no_traceback(mode, tmp_path):
    extra = ["--reference"] if mode == "reference" else []
    run = Launched(run_file(tmp_path), "--steps", "2000", *extra)
    run.wait_for_step(2)
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    code, stderr = run.finish(limit=2 * TIMEOUT + 30)
    assert code == 128 + signal.SIGINT
    lines = [line for line in stderr.splitlines() if not line.startswith("pipefisher run")]
    assert len(lines) == 1 and "stopped at step" in lines[0] and "by SIGINT" in lines[0], stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr


def test_ranks_of_a_launcher_killed_outright_stop_with_a_checkpoint(tmp_path):
    """SIGKILL cannot be forwarded: each orphaned rank sees its launcher gone and sends itself SIGTERM."""
    run = Launched(run_file(tmp_path), "--steps", "2000")
    run.wait_for_step(3)
    ranks = run.ranks()
    run.proc.kill()
    end = time.monotonic() + TIMEOUT + 10
    while not all(gone(pid) for pid in ranks):
        assert time.monotonic() < end, "orphaned ranks train on"
        time.sleep(0.1)
    saved = sorted((tmp_path / "ck").glob("step-*/manifest.json"))
    assert saved and json.loads(saved[-1].read_text())["step"] >= 3


def test_a_killed_rank_fails_the_run_without_a_success_summary(tmp_path):
    run = Launched(run_file(tmp_path), "--steps", "2000")
    run.wait_for_step(2)
    os.kill(run.ranks()[1], signal.SIGKILL)
    code, stderr = run.finish(limit=2 * TIMEOUT + 30)
    assert code == 1
    assert "pipefisher: run failed" in stderr and "rank 1: process exited with code -9" in stderr
    assert "final loss" not in stderr


def corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "bit-flipped"])
def test_resume_names_a_corrupt_rank_file_and_falls_back_to_the_previous_checkpoint(
    how, tmp_path, straight, four_steps
):
    config = run_file(tmp_path, every=2, keep=2)
    folder = tmp_path / "ck"
    shutil.copytree(four_steps, folder)
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-000002", "step-000004"]
    bad = folder / "step-000004" / "rank-1.pt"
    corrupt(bad, how)
    resumed = pipefisher("run", config, "--resume", "--steps", 6, "--json", "--master-port", 0)
    assert resumed.returncode == 0, resumed.stderr
    why = "truncated or overwritten" if how == "truncated" else "its SHA-256 differs from the manifest's (corrupt)"
    moved = folder / "corrupt-step-000004"
    assert f"pipefisher: checkpoint step 4 does not verify ({bad}: " in resumed.stderr and why in resumed.stderr
    assert f"): moved to {moved}\n" in resumed.stderr and (moved / "rank-1.pt").exists()
    assert "pipefisher: resuming from step 2, the newest checkpoint that verifies" in resumed.stderr
    assert losses(resumed) == {s: loss for s, loss in straight.items() if 2 < s <= 6}
    # the corrupt step 4 of the abandoned history was set aside; the kept ones all verify
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-000004", "step-000006"]
    again = pipefisher("run", config, "--resume", "--steps", 6, "--master-port", 0)
    assert again.returncode == 0 and "nothing to do" in again.stderr and "checkpoint step" not in again.stderr


def test_resume_without_any_good_checkpoint_is_refused_with_the_reason(tmp_path):
    config = run_file(tmp_path, keep=1)
    assert pipefisher("run", config, "--steps", 2, "--master-port", 0).returncode == 0
    bad = tmp_path / "ck" / "step-000002" / "rank-0.pt"
    corrupt(bad, "truncated")
    result = pipefisher("run", config, "--resume", "--steps", 4, "--master-port", 0)
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"pipefisher: error: no checkpoint in {tmp_path / 'ck'} to resume from (step 2: {bad}: "
    )
    assert result.stderr.count("\n") == 1


def fault_script(tmp_path) -> Path:
    """`pipefisher run` whose rank 1 kills itself during step 4 of the first attempt only."""
    script = tmp_path / "faulty_run.py"
    script.write_text(
        "import os, signal, sys\n"
        "from pipefisher.runtime.pipeline import plan_runner\n"
        "original = plan_runner.PlanRunner.run_step\n"
        "def run_step(self, step):\n"
        "    if step == 3 and self.rank == 1 and os.environ.get('TORCHELASTIC_RESTART_COUNT') == '0':\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return original(self, step)\n"
        "plan_runner.PlanRunner.run_step = run_step\n"
        "from pipefisher.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return script


@pytest.mark.slow
def test_torchrun_restarts_after_a_dead_rank_and_continues_from_the_checkpoint(tmp_path, straight):
    config = run_file(tmp_path, every=1, resume="auto")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TORCHELASTIC", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))
    }
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            str(fault_script(tmp_path)),
            "run",
            str(config),
            "--steps",
            "6",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    steps = [line["step"] for line in lines]
    assert steps[:3] == [1, 2, 3] and steps[-3:] == [4, 5, 6], steps  # the restart went on from step 3
    assert "resuming from step 3" in result.stderr
    assert {line["step"]: line["loss"] for line in lines} == {s: loss for s, loss in straight.items() if s <= 6}
