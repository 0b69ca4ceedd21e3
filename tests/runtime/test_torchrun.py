"""`pipefisher run`/`profile` under torchrun, as on a cluster: two agents on 127.0.0.1 as two nodes."""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from pipefisher.core.profile import load_profile
from pipefisher.runtime.training.rendezvous import free_port

pytestmark = pytest.mark.dist

TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"
TIMEOUT = 120  # seconds for every process a test starts; then the whole process group is killed


def child_env() -> dict[str, str]:
    """This environment without any torchrun variables: one thread per process, CPU only, gloo on loopback."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key
        not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
        and not key.startswith("TORCHELASTIC_")
    }
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU: on a GPU machine two "nodes" would share cuda:0 under NCCL
    if "lo" in {name for _, name in socket.if_nameindex()}:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the agents meet on 127.0.0.1; keep gloo there too
    return env


def start(args: list[str], log: Path) -> subprocess.Popen:
    """Start `args` in its own session (so a kill reaches torchrun's workers), stdout/stderr to files."""
    out, err = open(log.with_suffix(".out"), "w"), open(log.with_suffix(".err"), "w")
    with out, err:
        return subprocess.Popen(args, stdout=out, stderr=err, env=child_env(), start_new_session=True)


def finish(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[int]:
    """Wait for every process; kill them all (with their children) if one fails or time runs out."""
    end = time.monotonic() + timeout
    try:
        while any(proc.poll() is None for proc in procs):
            if time.monotonic() > end or any(proc.poll() not in (None, 0) for proc in procs):
                break
            time.sleep(0.1)
        if any(proc.poll() not in (None, 0) for proc in procs):
            deadline = time.monotonic() + 10  # peers of a failed process fail on their own soon
            while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return [proc.returncode for proc in procs]


def step_lines(text: str) -> list[dict]:
    lines = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and "step" in value:
            lines.append(value)
    return lines


@pytest.mark.slow
def test_two_torchrun_nodes_train_like_the_local_launcher(tmp_path):
    port = free_port()
    run = ["-m", "pipefisher", "run", str(TINY), "--steps", "3", "--json"]
    # Static rendezvous (node ranks given): with c10d's dynamic one, an agent whose peer hosted the
    # store and left first can fail polling it after training ended (a torchrun race, not ours).
    agent = [
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--max-restarts",
        "0",
    ]
    procs = [start(agent + ["--node-rank", str(node)] + run, tmp_path / f"node{node}") for node in range(2)]
    procs.append(
        start(["pipefisher", "run", str(TINY), "--steps", "3", "--json", "--master-port", "0"], tmp_path / "local")
    )
    codes = finish(procs)
    logs = {
        name: ((tmp_path / name).with_suffix(".out").read_text(), (tmp_path / name).with_suffix(".err").read_text())
        for name in ("node0", "node1", "local")
    }
    assert codes == [0, 0, 0], "\n".join(
        f"--- {name} (exit {code}) ---\n{out}\n{err[-3000:]}" for (name, (out, err)), code in zip(logs.items(), codes)
    )
    nodes = step_lines(logs["node0"][0]) + step_lines(logs["node1"][0])  # only rank 0's process prints them
    local = step_lines(logs["local"][0])
    assert [line["step"] for line in nodes] == [1, 2, 3]
    assert [line["step"] for line in local] == [1, 2, 3]
    assert [line["loss"] for line in nodes] == pytest.approx([line["loss"] for line in local], rel=1e-6)


def test_profile_under_torchrun_writes_a_profile(tmp_path):
    output = tmp_path / "profile.yaml"
    proc = start(
        [
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "pipefisher",
            "profile",
            str(TINY),
            "-o",
            str(output),
            "--repeats",
            "1",
        ],
        tmp_path / "profile",
    )
    [code] = finish([proc])
    out, err = (tmp_path / "profile.out").read_text(), (tmp_path / "profile.err").read_text()
    assert code == 0, f"{out}\n{err[-3000:]}"
    profile = load_profile(str(output))
    assert len(profile.stages) == 2
    assert all(stage.forward > 0 and stage.backward > 0 for stage in profile.stages)
    assert f"wrote {output}" in out
