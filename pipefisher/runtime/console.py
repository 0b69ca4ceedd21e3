"""Where the runtime's diagnostics go: the runtime's modules log them
(`logging.getLogger(__name__)`, under the ``pipefisher`` logger) and print nothing themselves;
the CLI, and every rank process the launcher starts for it, calls `show_runtime_messages` so
that each one is a ``pipefisher: <message>`` line on stderr, flushed at once. A library user
who calls the runtime directly chooses their own handlers (none: only warnings show, by
`logging`'s last resort)."""

from __future__ import annotations

import logging
import sys


class _StderrLines(logging.Handler):
    """Each record as ``pipefisher: <message>`` on the current `sys.stderr` (looked up at every
    record: a rank takes the launcher's streams after it starts), flushed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(f"pipefisher: {record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def show_runtime_messages() -> None:
    """Print the package's log records of level INFO and above as ``pipefisher: ...`` lines on
    stderr (once per process, however often called)."""
    logger = logging.getLogger("pipefisher")
    if not any(isinstance(handler, _StderrLines) for handler in logger.handlers):
        logger.addHandler(_StderrLines())
    logger.setLevel(logging.INFO)
