"""The stop request a signal leaves in this process, read by the end of a step
(`pipefisher.runtime.gradient_path.step_end`) and set by the entry points
(`pipefisher.runtime.training.stopping` says how a run stops on a signal)."""

from __future__ import annotations

import signal

#: the signals that stop a run after the step in progress
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
