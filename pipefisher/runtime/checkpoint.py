"""Checkpoints: one file per rank per saved step, written atomically, plus a `latest` marker.

Layout: ``DIR/step-000006/rank-0.pt`` … and ``DIR/latest`` (JSON: step, configuration). A rank
writes its file to a temporary name and renames it into place; rank 0 moves `latest` only after
every rank has written, so a run killed while writing leaves the previous checkpoint complete and
pointed to. A checkpoint is only resumed by a run of the same configuration (everything except
the step count, checkpointing, ports, backend and timeouts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from pipefisher.config import RunConfig

#: configuration keys that may change between a run and its resumption
_FREE = {
    ("run", "steps"), ("run", "master_port"), ("run", "master_addr"), ("run", "backend"), ("run", "timeout"), ("run", "metrics"),
    ("run", "bucket_mb"), ("run", "in_order"), ("checkpoint", "dir"), ("checkpoint", "every"), ("checkpoint", "keep"),
}


class CheckpointError(ValueError):
    """No usable checkpoint, or one of another configuration; the message says which key differs."""


def identity(config: RunConfig) -> dict[str, Any]:
    """The configuration keys a resumed run must share, as a flat {"section.key": value} dict."""
    flat = {}
    for section, values in dataclasses.asdict(config).items():
        for key, value in values.items():
            if (section, key) not in _FREE:
                flat[f"{section}.{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def _atomic_write(path: Path, write) -> None:
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(temporary)
    os.replace(temporary, path)


def save_rank(directory: str | Path, step: int, rank: int, state: dict[str, Any]) -> None:
    """Write this rank's state for `step` (steps completed) atomically."""
    folder = Path(directory) / f"step-{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / f"rank-{rank}.pt", lambda path: torch.save(state, path))


def mark_latest(directory: str | Path, step: int, config: RunConfig, keep: int = 2) -> None:
    """Point `latest` at `step` (call after every rank saved it) and drop older checkpoints
    beyond the `keep` newest."""
    directory = Path(directory)
    text = json.dumps({"step": step, "config": identity(config)}, indent=1)
    _atomic_write(directory / "latest", lambda path: path.write_text(text + "\n"))
    steps = sorted(p for p in directory.glob("step-*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def latest_step(directory: str | Path, config: RunConfig) -> int:
    """The step of the newest complete checkpoint of this configuration; CheckpointError if
    there is none or it belongs to another configuration."""
    marker = Path(directory) / "latest"
    if not marker.exists():
        raise CheckpointError(f"no checkpoint in {directory} to resume from (no 'latest' file)")
    data = json.loads(marker.read_text())
    ours = identity(config)
    for key in sorted(set(ours) | set(data["config"])):
        if data["config"].get(key) != ours.get(key):
            raise CheckpointError(
                f"the checkpoint in {directory} is from another configuration: {key} is "
                f"{data['config'].get(key)!r} there and {ours.get(key)!r} here"
            )
    return int(data["step"])


def load_rank(directory: str | Path, step: int, rank: int, device: torch.device) -> dict[str, Any]:
    path = Path(directory) / f"step-{step:06d}" / f"rank-{rank}.pt"
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} is missing")
    return torch.load(path, map_location=device, weights_only=False)
