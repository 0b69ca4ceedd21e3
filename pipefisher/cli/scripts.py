"""How a program started from the command line (`pipefisher`, a script of experiments/) meets
SIGINT and SIGTERM: `entry_point(main, program)` runs its `main` so that a signal at any moment
ends it with one line and 128 + signal, no traceback."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from pipefisher.runtime.signals import STOP_SIGNALS
from pipefisher.runtime.training.stopping import Terminated, raise_on_sigterm, signal_name


def interruption_exit(exc: BaseException, program: str) -> int:
    """Say in one line that `exc` (KeyboardInterrupt or Terminated) stopped `program`; its exit code."""
    signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
    print(f"{program}: interrupted by {signal_name(signum)}", file=sys.stderr, flush=True)
    return 128 + signum


def entry_point(main: Callable[[], int | None], program: str) -> int:
    """Run a script's `main` so that SIGINT or SIGTERM at any moment ends it with one line and
    128 + signal, no traceback; `main`'s own code (None: 0) otherwise.

    An interrupted program leaves through `os._exit` (its streams flushed, its children already
    ended by the launcher): CPython kills itself with SIGINT at exit, whatever the program did,
    once a KeyboardInterrupt has passed through one of its C-level runs of Python code (seen
    here in about one start in four when the signal came in the first 0.2 s), which turned a
    caught Ctrl-C into death by signal instead of 130."""
    raise_on_sigterm()
    try:
        code = main() or 0
    except (KeyboardInterrupt, Terminated) as exc:
        code = interruption_exit(exc, program)
    if code in {128 + signum for signum in STOP_SIGNALS}:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
