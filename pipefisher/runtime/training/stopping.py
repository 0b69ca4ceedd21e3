"""Stopping on a signal without losing anything.

SIGTERM (preemption, time limits) or SIGINT (Ctrl-C) to a rank only sets a flag; the flag goes
into the end-of-step reduction over all ranks (`StepEnd`), so every rank learns in the same step
that one of them was signalled (`pipefisher.runtime.signals`). They all finish that step, write a
checkpoint when a checkpoint directory is set, and exit with 128 + the signal's number. A
program's entry point (`pipefisher.cli.scripts.entry_point`) says in one line what stopped it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pipefisher.runtime.signals import STOP_SIGNALS


class Terminated(BaseException):
    """SIGTERM in a process with no step to finish (planning, preparing data, starting): raised
    like KeyboardInterrupt is for SIGINT, so the entry point (`pipefisher.cli.scripts`) says one line
    and exits 143."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Processes started inside start with SIGINT and SIGTERM blocked, so that none dies with a
    traceback inside its interpreter's start; each lets them in once its handling is set. A signal
    that reaches this process meanwhile is handled when the block ends."""
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises `Terminated` (main thread only), until a handler replaces it."""

    def terminate(signum: int, frame) -> None:
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, terminate)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


@dataclass
class Stopped(Exception):
    """The run stopped after `step` completed steps on signal `signum`; `checkpoint_dir`: where
    that step was saved (None: no checkpoint directory)."""

    step: int
    signum: int
    checkpoint_dir: str | None = None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        saved = (
            f"checkpoint step {self.step} in {self.checkpoint_dir}"
            if self.checkpoint_dir
            else "no checkpoint (set --checkpoint-dir to keep the progress)"
        )
        return f"stopped at step {self.step} by {signal_name(self.signum)}; {saved}"
