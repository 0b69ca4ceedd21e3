"""`pipefisher run` from a real process, as users run it."""

import json
import socket
import subprocess
from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["pipefisher", "run", str(TINY), *args], capture_output=True, text=True, timeout=timeout)


def losses(result: subprocess.CompletedProcess) -> list[float]:
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    return [line["loss"] for line in lines]


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
    result = run_cli("--steps", "2", "--json", "--reference")
    assert result.returncode == 0, result.stderr
    return losses(result)


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "chimera", "zb-h1"])
def test_run_prints_one_json_object_per_step(schedule, reference_losses):
    result = run_cli("--schedule", schedule, "--steps", "2", "--json", "--master-port", "0")
    assert result.returncode == 0, result.stderr
    got = losses(result)
    assert len(got) == 2
    if schedule != "interleaved":  # interleaved cuts the model into 4 chunks: another initialisation
        assert got == pytest.approx(reference_losses, rel=1e-5)


def test_text_output_names_units(reference_losses):
    result = run_cli("--steps", "1", "--reference")
    assert result.returncode == 0
    assert result.stdout.startswith("step 1/1  loss ") and result.stdout.rstrip().endswith(" ms")


@pytest.mark.parametrize(
    "content, message",
    [
        ("pipeline:\n  stages: 3\n", "model.layers: 4 blocks cannot be split into 3 equal stages (pipeline.stages 3); "
                                     "make pipeline.stages a divisor of 4: 1, 2 or 4"),
        ("checkpoint:\n  resume: auto\n", "checkpoint.resume: 'auto' needs checkpoint.dir (or --checkpoint-dir)"),
        ("pipeline:\n  schedule: chimera\n  micro_batches: 3\n", "micro-batches N=3 must be a multiple of stages D=2"),
        ("pipeline:\n  stagez: 2\n", "pipeline.stagez: unknown key; allowed keys: schedule, stages"),
        ("optimizer:\n  name: adam\n", "optimizer.name: 'adam' is not one of sgd, adamw, lamb, kfac"),
        ("run:\n  steps: 0\n", "run.steps: 0 must be positive"),
        ("model: [1, 2]\n", "model: expected a mapping"),
    ],
)
def test_bad_run_files_exit_2_with_one_line(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = subprocess.run(["pipefisher", "run", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_more_nccl_ranks_than_gpus_exits_2_before_starting_processes(tmp_path):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU for each of the run's 2 ranks")
    for command in (["run"], ["profile", "-o", str(tmp_path / "profile.yaml")]):
        result = subprocess.run(["pipefisher", *command, str(TINY), "--backend", "nccl"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            f"pipefisher: error: run.backend nccl: 2 processes on this machine need 2 GPUs, it has {torch.cuda.device_count()} "
            "(one GPU cannot host two NCCL ranks); use --backend gloo, or fewer ranks (pipeline.stages x pipeline.data_parallel)"]


def test_port_in_use_exits_2_before_starting_processes():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_cli("--master-port", str(port), timeout=30)
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.dist
def test_run_under_torchrun_uses_its_ranks(reference_losses):
    result = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "pipefisher", "run", str(TINY), "--steps", "2", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert losses(result) == pytest.approx(reference_losses, rel=1e-5)


def test_torchrun_with_the_wrong_world_size_exits_2():
    result = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "pipefisher", "run", str(TINY), "--steps", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "torchrun started 1 processes; the run needs 2" in result.stderr


def test_usage_messages_name_things_once(tmp_path):
    """No doubled `pipefisher: error: pipefisher ...` prefix, no path said twice."""
    result = subprocess.run(["pipefisher", "run", str(TINY), "--steps", "x"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "pipefisher: error: argument --steps: 'x' is not an integer (see pipefisher run --help)\n"
    missing = tmp_path / "missing.yaml"
    result = subprocess.run(["pipefisher", "run", str(TINY), "--optimizer", "kfac", "--profile", str(missing)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count(str(missing)) == 1, result.stderr


def test_the_profilers_header_says_what_it_measures(tmp_path):
    result = subprocess.run(["pipefisher", "profile", str(TINY), "-o", str(tmp_path / "p.yaml"), "--repeats", "2", "--master-port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    header = result.stderr.splitlines()[0]
    assert "1 warm-up and 2 measured steps (gradients dropped)" in header and "20 steps" not in header, header
