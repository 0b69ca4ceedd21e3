"""SIGINT (a terminal's Ctrl-C, sent to the whole foreground group) and SIGTERM at any moment of
a command: one line naming the signal, exit 128 + signal, no traceback or C++ stack, no process
left, nothing half-written. Mid-training stops (a checkpoint after the step) are in test_faults.py.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"


class Command:
    """`pipefisher ARGS` in its own session (its own process group), stderr collected as it comes."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipefisher", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()

    def wait_for(self, text: str, limit: float = 60) -> None:
        end = time.monotonic() + limit
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < end, f"never printed {text!r}"
            time.sleep(0.02)

    def wait_for_handler(self, limit: float = 60) -> None:
        """Until the process catches SIGTERM: `entry_point` has put pipefisher's handlers in, the
        first thing its Python code does (before that, the interpreter is still starting and a
        signal's default action ends it: no program can answer it yet)."""
        end = time.monotonic() + limit
        while not catches(self.proc.pid, signal.SIGTERM):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < end, "never caught SIGTERM"
            time.sleep(0.002)

    def interrupt(self, signum: int, limit: float = 60) -> tuple[int, list[str]]:
        """Send `signum` to the whole group; the exit code and stderr's lines once it ended, after
        checking that no process of the group is left running."""
        os.killpg(self.proc.pid, signum)
        code = self.proc.wait(timeout=limit)
        self.reader.join(10)
        end = time.monotonic() + 10
        while running_in_session(self.proc.pid):
            assert time.monotonic() < end, f"processes left: {running_in_session(self.proc.pid)}"
            time.sleep(0.1)
        return code, [line.rstrip("\n") for line in self.lines]


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of `signum` (its `SigCgt` mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (signum - 1) & 1)


def running_in_session(session: int) -> list[str]:
    """Processes of `session` that still run (exited ones waiting to be reaped do not count)."""
    listing = subprocess.run(
        ["ps", "-o", "pid=,stat=,args=", "-s", str(session)], capture_output=True, text=True
    ).stdout
    return [line for line in listing.splitlines() if line.split()[1][0] != "Z"]


def assert_one_line(lines: list[str], signum: int, header: str, said: str) -> None:
    name = signal.Signals(signum).name
    text = "\n".join(lines)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "frame #" not in text, text
    rest = [line for line in lines if not line.startswith(header)]
    assert len(rest) == 1 and said in rest[0] and name in rest[0], text


@pytest.mark.parametrize(
    "moment, signum",
    [
        ("starting", signal.SIGTERM),
        ("ranks starting", signal.SIGINT),
        ("first step", signal.SIGTERM),
        ("starting", signal.SIGINT),
    ],
)
def test_a_run_stopped_at_any_moment_says_one_line(moment, signum):
    """'starting': the handlers are in and the CLI's modules load; 'ranks starting': the header is
    out and the rank processes start (their own start-up, rendezvous); 'first step': the ranks train."""
    run = Command("run", str(TINY), "--steps", "100000", "--master-port", "0")
    if moment == "starting":
        run.wait_for_handler()
    elif moment == "ranks starting":
        run.wait_for("pipefisher run:")
    else:
        run.wait_for("pipefisher run:")
        time.sleep(4)
    code, lines = run.interrupt(signum)
    assert code == 128 + signum
    said = "interrupted by" if moment == "starting" else "by "
    assert_one_line(lines, signum, "pipefisher run", said)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_profile_stopped_while_measuring_writes_nothing(signum, tmp_path):
    output = tmp_path / "profile.yaml"
    run = Command("profile", str(TINY), "-o", str(output), "--master-port", "0")
    run.wait_for("pipefisher profile:")
    time.sleep(1)
    code, lines = run.interrupt(signum)
    assert code == 128 + signum
    assert_one_line(lines, signum, "pipefisher profile", "interrupted by")
    assert list(tmp_path.iterdir()) == []


def test_a_long_simulation_stopped_says_one_line():
    run = Command("simulate", "--schedule", "1f1b", "-D", "256", "-N", "1024")
    time.sleep(2)
    code, lines = run.interrupt(signal.SIGINT)
    assert code == 128 + signal.SIGINT
    assert_one_line(lines, signal.SIGINT, "never", "interrupted by")


class Script(Command):
    """`python experiments/NAME.py ARGS` in its own session (a Command of another program)."""

    def __init__(self, name: str, *args: str):
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, str(root / "experiments" / f"{name}.py"), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=root,
        )
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_experiment_stopped_says_one_line(signum):
    """The packer benchmark (planning only, a minute and more of work) stopped after 2 s."""
    run = Script("bench_packer")
    time.sleep(2)
    code, lines = run.interrupt(signum)
    assert code == 128 + signum
    assert_one_line(lines, signum, "never", "bench_packer: interrupted by")


def test_an_experiment_stopped_while_its_pipefisher_child_runs_leaves_no_traceback(tmp_path):
    """convergence.py times AdamW with a `pipefisher run` child after its grid: both say one line."""
    out = tmp_path / "out"
    run = Script(
        "convergence",
        "--workloads",
        "bert",
        "--methods",
        "adamw",
        "--steps",
        "3",
        "--seeds",
        "1",
        "--cache",
        str(tmp_path / "cache"),
        "--out",
        str(out / "c"),
    )
    run.wait_for("`pipefisher run` now", limit=180)
    time.sleep(3)
    code, lines = run.interrupt(signal.SIGINT)
    assert code == 130
    text = "\n".join(lines)
    assert "Traceback" not in text and "frame #" not in text, text
    assert lines[-1] == "convergence: interrupted by SIGINT", text
    assert not out.exists()
