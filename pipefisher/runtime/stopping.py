"""Stopping on a signal without losing anything.

SIGTERM (preemption, time limits) or SIGINT (Ctrl-C) to a rank only sets a flag; the flag goes
into the end-of-step reduction over all ranks (`StepEnd`), so every rank learns in the same step
that one of them was signalled. They all finish that step, write a checkpoint when a checkpoint
directory is set, and exit with 128 + the signal's number.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The signal this process received (0: none). Installed once per process by its entry point."""

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> None:
        """Catch SIGTERM and SIGINT from now on (main thread only)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame) -> None:
        self.signum = signum


#: this process's stop request (signals are per process)
stop_request = StopRequest()


class Terminated(BaseException):
    """SIGTERM in a process with no step to finish (planning, preparing data, starting): raised
    like KeyboardInterrupt is for SIGINT, so the entry point says one line and exits 143."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


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
        saved = f"checkpoint step {self.step} in {self.checkpoint_dir}" if self.checkpoint_dir else \
            "no checkpoint (set --checkpoint-dir to keep the progress)"
        return f"stopped at step {self.step} by {signal_name(self.signum)}; {saved}"
