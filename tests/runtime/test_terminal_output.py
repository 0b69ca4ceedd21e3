"""A run in a terminal (stderr a TTY): the progress bar, and not one line from a third party."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"


def test_a_run_in_a_terminal_draws_its_bar_and_ends_without_third_party_warnings():
    """tqdm's default lock is a multiprocessing semaphore, which a rank leaving with os._exit
    never frees: the resource tracker then warned of a leaked semaphore after every run."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal of 100 columns
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipefisher", "run", str(TINY), "--steps", "3", "--master-port", "0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=terminal,
    )
    os.close(terminal)
    output = b""
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # every writer closed the terminal: the run and its resource tracker are done
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    assert proc.wait(timeout=30) == 0
    text = output.decode(errors="replace")
    assert "/3 [" in text, text  # the progress bar: n/3 [elapsed<remaining]
    assert "Warning" not in text and "leaked" not in text, text
