"""The stop requests of this process, read by the end of a step
(`pipefisher.runtime.gradient_path.step_end`): the signal it received, set by the entry points
(`pipefisher.runtime.training.stopping` says how a run stops on a signal), and the deadline of
the run's time budget (`run.time_budget_s`), set by the training loop."""

from __future__ import annotations

import signal
import time

#: the signals that stop a run after the step in progress
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """`signum`: the signal this process received (0: none; installed once per process by its
    entry point). `deadline`: a `time.perf_counter()` reading past which the step in progress is
    the run's last (None: no time budget)."""

    def __init__(self) -> None:
        self.signum = 0
        self.deadline: float | None = None

    def out_of_time(self) -> bool:
        """Whether the time budget's deadline has passed (a host clock read, no device sync)."""
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def install(self) -> None:
        """Catch SIGTERM and SIGINT from now on (main thread only)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame) -> None:
        self.signum = signum


#: this process's stop request (signals are per process)
stop_request = StopRequest()
