"""What only the experiments share."""

from __future__ import annotations

import tempfile
from pathlib import Path

#: the checkout's root
ROOT = Path(__file__).resolve().parents[1]


def experiment_output(name: str) -> Path:
    """Where an experiment writes unless told otherwise (its --out): a folder of the temporary
    directory, never a tracked file of the checkout (the README's figures are rewritten only by
    naming them)."""
    return Path(tempfile.gettempdir()) / "pipefisher-experiments" / name
