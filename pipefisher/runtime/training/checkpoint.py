"""Checkpoints: one file per rank per saved step, a manifest that makes the step complete, and a
resume that verifies before it trusts.

Layout: ``DIR/step-000006/rank-0.pt`` …, ``DIR/step-000006/manifest.json`` (the configuration and
every rank file's size and SHA-256) and ``DIR/latest`` (the newest step, for people). A rank
writes its file to a temporary name, flushes it to disk, hashes what is on disk and renames it into
place; rank 0 writes the manifest (atomically) only after every rank has, so a step without a
manifest is incomplete. Resuming takes the newest step whose manifest is of this configuration
and whose files all verify, and names every newer one it skips and why. Pruning keeps the `keep`
newest complete steps of the run's own history and never the newly written one.
A checkpoint is only resumed by a run of the same configuration (everything except the step count,
checkpointing, ports, backend, timeouts, bucket size and the in-order test mode).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipefisher.config import RunConfig, config_to_dict
from pipefisher.core.files import write_atomically

#: configuration keys that may change between a run and its resumption
_FREE = {
    ("run", "steps"), ("run", "master_port"), ("run", "master_addr"), ("run", "backend"), ("run", "timeout"), ("run", "metrics"),
    ("run", "bucket_mb"), ("run", "in_order"), ("checkpoint", "dir"), ("checkpoint", "every"), ("checkpoint", "keep"),
    ("checkpoint", "resume"),
}
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """No usable checkpoint, or one of another configuration; the message says why."""


@dataclass(frozen=True)
class FileRecord:
    """A rank file as written: its name in the step's folder, size in bytes and SHA-256 (hex)."""

    name: str
    size: int
    sha256: str


def identity(config: RunConfig) -> dict[str, Any]:
    """The configuration keys a resumed run must share, as a flat {"section.key": value} dict."""
    flat = {}
    for section, values in config_to_dict(config).items():
        for key, value in values.items():
            if (section, key) not in _FREE:
                flat[f"{section}.{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def step_folder(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def _steps(directory: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step folder, newest first."""
    found = []
    for folder in directory.glob("step-*"):
        suffix = folder.name[len("step-"):]
        if folder.is_dir() and suffix.isdigit():
            found.append((int(suffix), folder))
    return sorted(found, reverse=True)


def has_checkpoints(directory: str | Path) -> bool:
    """Whether `directory` holds any step folder (complete or not)."""
    return bool(_steps(Path(directory)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write(path: Path, write) -> None:
    """`write(temporary)`, flush it to disk, then rename it to `path`."""
    write_atomically(path, write, durable=True)


def save_rank(directory: str | Path, step: int, rank: int, state: dict[str, Any]) -> FileRecord:
    """Write this rank's state for `step` (steps completed) atomically; its record for the manifest.
    Rank 0 also drops a stale manifest of that step first (the manifest comes after every file)."""
    folder = step_folder(directory, step)
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (folder / MANIFEST).unlink(missing_ok=True)
    path = folder / f"rank-{rank}.pt"
    _atomic_write(path, lambda temporary: torch.save(state, temporary))
    return FileRecord(path.name, path.stat().st_size, _sha256(path))


def commit(directory: str | Path, step: int, config: RunConfig, records: list[FileRecord], keep: int = 2) -> None:
    """Rank 0, once every rank saved `step`: write its manifest, point `latest` at it, and prune:
    later steps (another history, e.g. after resuming from an earlier step) and complete steps
    beyond the `keep` newest go; an incomplete step older than the kept ones goes too."""
    directory = Path(directory)
    folder = step_folder(directory, step)
    for record in records:
        size = (folder / record.name).stat().st_size
        if size != record.size:
            raise CheckpointError(f"{folder / record.name}: {size} bytes on disk, {record.size} written; checkpoint not committed")
    manifest = {"step": step, "config": identity(config), "files": {r.name: {"size": r.size, "sha256": r.sha256} for r in records}}
    _atomic_write(folder / MANIFEST, lambda path: path.write_text(json.dumps(manifest, indent=1) + "\n"))
    _atomic_write(directory / "latest", lambda path: path.write_text(json.dumps({"step": step}) + "\n"))
    kept = 0
    for other, path in _steps(directory):
        if other > step:
            shutil.rmtree(path, ignore_errors=True)
        elif (path / MANIFEST).exists() and kept < max(keep, 1):
            kept += 1
        elif other < step:
            shutil.rmtree(path, ignore_errors=True)


def _problem(folder: Path, manifest: dict, world_size: int) -> str | None:
    """Why the step in `folder` cannot be resumed, or None when every rank file verifies."""
    files = manifest.get("files", {})
    for rank in range(world_size):
        name = f"rank-{rank}.pt"
        path = folder / name
        if name not in files:
            return f"{path}: not in the manifest"
        if not path.exists():
            return f"{path}: missing"
        size, expected = path.stat().st_size, files[name]["size"]
        if size != expected:
            return f"{path}: {size} bytes, the manifest says {expected} (truncated or overwritten)"
        if _sha256(path) != files[name]["sha256"]:
            return f"{path}: its SHA-256 differs from the manifest's (corrupt)"
    return None


def _before_added(config: RunConfig) -> dict[str, Any]:
    """Keys added since checkpoints were written whose behaviour then was not today's default: a
    curvature run's other parameters stepped with its method's SGD (`first_order` sgd)."""
    return {f"{config.optimizer.name}.first_order": "sgd"} if config.curvature is not None else {}


def resumable_step(directory: str | Path, config: RunConfig) -> tuple[int, list[str]]:
    """The newest step of this configuration whose files all verify, and one line for every newer
    step it skips (why). CheckpointError if there is none, or the newest complete step is of
    another configuration."""
    directory = Path(directory)
    skipped: list[str] = []
    ours = identity(config)
    defaults = {**identity(RunConfig()), **_before_added(config)}  # keys added since a checkpoint was written
    for step, folder in _steps(directory):
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except FileNotFoundError:
            skipped.append(f"step {step}: incomplete (no {MANIFEST}: stopped while saving)")
            continue
        except (OSError, ValueError):
            skipped.append(f"step {step}: {folder / MANIFEST} is unreadable")
            continue
        theirs = {**defaults, **manifest.get("config", {})}
        differing = next((key for key in sorted(set(ours) | set(theirs)) if theirs.get(key) != ours.get(key)), None)
        if differing is not None:
            raise CheckpointError(
                f"the checkpoint in {directory} is from another configuration: {differing} is "
                f"{theirs.get(differing)!r} there and {ours.get(differing)!r} here; set {differing}: {theirs.get(differing)!r} to resume it"
            )
        problem = _problem(folder, manifest, config.world_size)
        if problem is None:
            return step, skipped
        skipped.append(f"step {step}: {problem}")
    reason = "; ".join(skipped) if skipped else "no step folders"
    raise CheckpointError(f"no checkpoint in {directory} to resume from ({reason})")


def load_rank(directory: str | Path, step: int, rank: int, device: torch.device) -> dict[str, Any]:
    path = step_folder(directory, step) / f"rank-{rank}.pt"
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} is missing")
    return torch.load(path, map_location=device, weights_only=False)
