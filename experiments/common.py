"""What only the experiments share."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pipefisher.core.usage import UsageError

#: the checkout's root
ROOT = Path(__file__).resolve().parents[1]


def experiment_output(name: str) -> Path:
    """Where an experiment writes unless told otherwise (its --out): a folder of the temporary
    directory, never a tracked file of the checkout (the README's figures are rewritten only by
    naming them)."""
    return Path(tempfile.gettempdir()) / "pipefisher-experiments" / name


class RunFailed(RuntimeError):
    """A `pipefisher run` of a benchmark failed; the message is one line."""


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
