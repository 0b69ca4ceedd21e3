"""What only the experiments share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pipefisher.core.usage import UsageError
from pipefisher.runtime.training import Terminated

#: the checkout's root
ROOT = Path(__file__).resolve().parents[1]


def experiment_output(name: str) -> Path:
    """Where an experiment writes unless told otherwise (its --out): a folder of the temporary
    directory, never a tracked file of the checkout (the README's figures are rewritten only by
    naming them)."""
    return Path(tempfile.gettempdir()) / "pipefisher-experiments" / name


class RunFailed(RuntimeError):
    """A `pipefisher run` of a benchmark failed; the message is one line."""


def checked(done: subprocess.CompletedProcess, argv: list[str]) -> None:
    """RunFailed, in one line (the command's program and first arguments, its exit code and its
    last line on stderr), unless the command `argv` that gave `done` exited 0."""
    if done.returncode != 0:
        last = ((done.stderr or "").strip().splitlines() or ["(no output)"])[-1]
        raise RunFailed(f"{' '.join(argv[2:5])} ... failed (exit {done.returncode}): {last}")


def progress(message: str) -> None:
    """One progress line on stderr."""
    print(message, file=sys.stderr, flush=True)


def listed(value: str, allowed: Iterable[str], flag: str) -> list[str]:
    """The comma-separated `value` of `flag`, each item one of `allowed` (UsageError otherwise)."""
    allowed = list(allowed)
    items = [item.strip() for item in value.split(",") if item.strip()]
    for item in items:
        if item not in allowed:
            raise UsageError(f"{flag}: {item!r} is not one of {', '.join(allowed)}")
    if not items:
        raise UsageError(f"{flag}: name at least one of {', '.join(allowed)}")
    return items


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have used (/proc/stat; 0 where unavailable)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def run_child(command: list[str], grace_s: float = 60.0, **options) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, check=False, **options)`, except
    when this process is stopped (SIGINT, SIGTERM): the child gets the same signal and `grace_s`
    seconds to end on its own (a `pipefisher run` stops its ranks and their forkserver), where
    subprocess.run would kill it 0.25 s after a Ctrl-C and leave whatever it had started behind."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options) as child:
        try:
            out, err = child.communicate()
        except (KeyboardInterrupt, Terminated) as stop:
            child.send_signal(signal.SIGINT if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM)
            try:
                child.wait(grace_s)
            except subprocess.TimeoutExpired:
                child.kill()
            raise
    return subprocess.CompletedProcess(command, child.returncode, out, err)
