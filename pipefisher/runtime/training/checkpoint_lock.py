"""A checkpoint folder has one writer: `hold_checkpoint_folder` takes an exclusive lock on
``DIR/.lock`` for a run's life, or refuses in one line naming the run that holds it.

The lock is `fcntl.flock` (LOCK_EX | LOCK_NB) on the open lock file: the operating system releases
it when the holder's process ends, however it ends, so the file of a dead run (it stays; it is never
removed, as removing a lock file races with a run opening it) blocks nothing. The holder writes
its pid, host, start time (UTC, ISO 8601) and command line into the file, for the refusal to name.

Who holds it: the `pipefisher run` process that started the local processes (it outlives them);
under torchrun, process 0 (RANK 0), the process that commits every step: the others write their
files only once the process group, which needs process 0, has formed. Pure Python (no torch).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

LOCK = ".lock"


class FolderInUse(RuntimeError):
    """Another live process holds the folder's lock; the message names it (one line)."""


def _holder(text: str) -> str:
    """The holder a lock file's text names, in words ("pid 1234 on host, started …")."""
    try:
        record = json.loads(text)
        return f"pid {record['pid']} on {record['host']}, started {record['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder not yet recorded"


@contextmanager
def hold_checkpoint_folder(directory: str | Path) -> Iterator[None]:
    """Hold `directory`'s lock (the folder is made if missing) until the block ends or the process
    does; FolderInUse at once when another process holds it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(descriptor, 4096, 0).decode("utf-8", "replace"))
            raise FolderInUse(
                f"checkpoint.dir {directory} is in use by another run ({holder}); "
                "wait for it to end or give another --checkpoint-dir"
            ) from None
        started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": started,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        }
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, (json.dumps(record) + "\n").encode(), 0)
        yield
    finally:
        os.close(descriptor)  # releases the lock
