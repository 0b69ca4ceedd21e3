"""Progress bars are drawn on a terminal only: a log file, a pipe or a test's capture of stderr
gets the commands' lines and none of a bar's redraws. Pure Python."""

from __future__ import annotations

import sys


def progress_bars() -> bool:
    """Whether a command draws progress bars (its own, and those of libraries it calls): exactly
    when stderr, where they go, is a terminal."""
    return sys.stderr.isatty()
