"""Checkpoint files: one file per process per saved step, a manifest that makes the step complete,
verification, pruning, and a reader that loads only the entries asked for.

Layout: ``DIR/step-000006/rank-0.pt`` …, ``DIR/step-000006/manifest.json`` and ``DIR/latest`` (the
newest step, for people). A process's file is a dict of entries under layout-free keys
(`pipefisher.runtime.training.checkpoint_state`). The manifest (format 2) holds what the run says
of itself (`pipefisher.runtime.training.resumption`: the configuration that must stay, the layout
that may change, the refresh cycle's position) and every file's size, SHA-256, keys and tensor
bytes per kind. A process writes its file to a temporary name, flushes it to disk, hashes what is
on disk and renames it into place; process 0 writes the manifest (atomically) only after every
process has, so a step without a manifest is incomplete. Retention (`prune`) keeps the `keep`
newest steps of the run's own history *that verify*, the new one first; a step that does not verify
is never counted nor chosen: it is moved aside to ``DIR/corrupt-step-000006/`` (`set_aside`), for
people to look at and delete. One run writes a folder (`checkpoint_lock`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipefisher.core.files import write_atomically

#: the manifest format this code writes and reads (1: the per-layout files before it, no field)
FORMAT = 2
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """No usable checkpoint, or one of another configuration; the message says why."""


@dataclass(frozen=True)
class FileRecord:
    """A process's file as written: its name in the step's folder, size in bytes, SHA-256 (hex),
    the keys of its entries and their tensor bytes per kind (`kind_of`)."""

    name: str
    size: int
    sha256: str
    keys: tuple[str, ...] = ()
    kind_bytes: tuple[tuple[str, int], ...] = ()


def kind_of(key: str) -> str:
    """The kind of an entry's key: its first part (model, optimizer, curvature, run), or for a
    process's own state (``local/<process>/<kind>/…``) that kind (rng, powersgd, cycle)."""
    parts = key.split("/")
    return parts[2] if parts[0] == "local" else parts[0]


def step_folder(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def steps(directory: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step folder, newest first (complete or not)."""
    found = []
    for folder in directory.glob("step-*"):
        suffix = folder.name[len("step-") :]
        if folder.is_dir() and suffix.isdigit():
            found.append((int(suffix), folder))
    return sorted(found, reverse=True)


def has_checkpoints(directory: str | Path) -> bool:
    """Whether `directory` holds any step folder (complete or not)."""
    return bool(steps(Path(directory)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write(path: Path, write) -> None:
    """`write(temporary)`, flush it to disk, then rename it to `path`."""
    write_atomically(path, write, durable=True)


def tensor_bytes(value: object, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the tensors in a nested structure of dicts, lists and tuples, each storage once
    (also across calls that share `seen`)."""
    seen = set() if seen is None else seen

    def visit(item: object) -> int:
        if isinstance(item, Tensor):
            key = (item.untyped_storage().data_ptr(), item.untyped_storage().nbytes())
            if key in seen:
                return 0
            seen.add(key)
            return item.untyped_storage().nbytes()
        if isinstance(item, dict):
            return sum(visit(v) for v in item.values())
        if isinstance(item, (list, tuple)):
            return sum(visit(v) for v in item)
        return 0

    return visit(value)


def save_rank(directory: str | Path, step: int, process: int, entries: dict[str, Any]) -> FileRecord:
    """Write this process's entries for `step` (steps completed) atomically; its record for the
    manifest. Process 0 also drops a stale manifest of that step first (it comes after every file)."""
    folder = step_folder(directory, step)
    folder.mkdir(parents=True, exist_ok=True)
    if process == 0:
        (folder / MANIFEST).unlink(missing_ok=True)
    path = folder / f"rank-{process}.pt"
    _atomic_write(path, lambda temporary: torch.save(entries, temporary))
    kinds: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()  # a storage under two keys counts for the first, as torch.save writes it once
    for key, value in entries.items():
        kinds[kind_of(key)] = kinds.get(kind_of(key), 0) + tensor_bytes(value, seen)
    return FileRecord(path.name, path.stat().st_size, _sha256(path), tuple(entries), tuple(sorted(kinds.items())))


def commit(
    directory: str | Path, step: int, run: dict[str, Any], records: list[FileRecord], keep: int = 2
) -> list[str]:
    """Process 0, once every process saved `step`: write its manifest (`run`: what it says of the
    run, `pipefisher.runtime.training.resumption.manifest_fields`), point `latest` at it, and
    `prune`; the lines to say (a step set aside)."""
    directory = Path(directory)
    folder = step_folder(directory, step)
    for record in records:
        size = (folder / record.name).stat().st_size
        if size != record.size:
            raise CheckpointError(
                f"{folder / record.name}: {size} bytes on disk, {record.size} written; checkpoint not committed"
            )
    manifest = {
        "format": FORMAT,
        "step": step,
        **run,
        "files": {
            r.name: {"size": r.size, "sha256": r.sha256, "bytes": dict(r.kind_bytes), "keys": list(r.keys)}
            for r in records
        },
    }
    _atomic_write(folder / MANIFEST, lambda path: path.write_text(json.dumps(manifest, indent=1) + "\n"))
    _atomic_write(directory / "latest", lambda path: path.write_text(json.dumps({"step": step}) + "\n"))
    _known_good[folder] = _signature(folder, manifest)  # every file was hashed on disk as it was written
    return prune(directory, step, keep)


def prune(directory: Path, step: int, keep: int) -> list[str]:
    """Keep `step` (just committed) and the newest older steps that verify, `keep` in all. Later
    steps go (another history, e.g. after resuming from an earlier step), and so do incomplete
    steps and the older ones beyond those kept. Only the candidates for keeping are verified (a
    step this process verified before, its files unchanged since, is not hashed again); one that
    does not verify is set aside. The lines to say, one per step set aside."""
    lines: list[str] = []
    kept = 0
    for other, path in steps(directory):
        if other == step:
            kept += 1
        elif other < step and kept < max(keep, 1) and (path / MANIFEST).exists():
            problem = step_problem(path)
            if problem is None:
                kept += 1
            else:
                lines.append(set_aside(path, other, problem))
        else:
            shutil.rmtree(path, ignore_errors=True)
    return lines


def set_aside(folder: Path, step: int, problem: str) -> str:
    """Move the step in `folder`, which does not verify (`problem`), to ``corrupt-step-NNNNNN``
    beside it (``-2``, ``-3`` … when that name is taken), out of every listing of steps; the line
    that says so ("step 6 does not verify (…): moved to …")."""
    target, copy_number = folder.with_name(f"corrupt-{folder.name}"), 1
    while target.exists():
        copy_number += 1
        target = folder.with_name(f"corrupt-{folder.name}-{copy_number}")
    os.replace(folder, target)
    _known_good.pop(folder, None)
    return f"step {step} does not verify ({problem}): moved to {target}"


#: steps this process knows to verify: folder -> `_signature` when it knew (hashed, or written)
_known_good: dict[Path, tuple] = {}


def _signature(folder: Path, manifest: dict) -> tuple:
    """The manifest's files as (name, size, modification time) on disk now (None: missing)."""

    def stat(name: str) -> tuple[int, int] | None:
        try:
            found = (folder / name).stat()
        except FileNotFoundError:
            return None
        return found.st_size, found.st_mtime_ns

    return tuple((name, stat(name)) for name in sorted(manifest.get("files", {})))


def step_problem(folder: Path) -> str | None:
    """Why the complete step in `folder` cannot be resumed (its manifest unreadable, or `verify`),
    or None; not hashed again when this process verified it and its files are unchanged."""
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError):
        return f"{folder / MANIFEST} is unreadable"
    if _known_good.get(folder) == _signature(folder, manifest):
        return None
    problem = verify(folder, manifest)
    if problem is None:
        _known_good[folder] = _signature(folder, manifest)
    return problem


def verify(folder: Path, manifest: dict) -> str | None:
    """Why the step in `folder` cannot be resumed, or None when every file of its manifest verifies."""
    files = manifest.get("files", {})
    if not files:
        return f"{folder / MANIFEST}: lists no files"
    for name, expected in sorted(files.items()):
        path = folder / name
        if not path.exists():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{path}: {size} bytes, the manifest says {expected['size']} (truncated or overwritten)"
        if _sha256(path) != expected["sha256"]:
            return f"{path}: its SHA-256 differs from the manifest's (corrupt)"
    return None


def read_manifest(folder: Path) -> dict:
    """The manifest of a step folder (FileNotFoundError: none; ValueError: unreadable)."""
    return json.loads((folder / MANIFEST).read_text())


class StateReader:
    """The entries of a step (verified by `resumable_step`), read on demand: each file is
    memory-mapped once, so only the entries asked for are read (each a copy). `aliases`: a tied weight's name
    -> its other copy's name, tried when an entry of the first is missing."""

    def __init__(self, directory: str | Path, step: int, aliases: dict[str, str] | None = None):
        self.folder = step_folder(directory, step)
        self.manifest = read_manifest(self.folder)
        self.index = {key: name for name, entry in self.manifest["files"].items() for key in entry["keys"]}
        self.aliases = aliases or {}
        self._files: dict[str, dict[str, Any]] = {}

    def _resolve(self, key: str) -> str | None:
        if key in self.index:
            return key
        head, _, name = key.rpartition("/")
        base, at, shard = name.partition("@")
        other = self.aliases.get(base)
        alias = f"{head}/{other}{at}{shard}" if other is not None else None
        return alias if alias in self.index else None

    def get(self, key: str, default: Any = None) -> Any:
        """The entry under `key` (or its tied alias), else `default`."""
        resolved = self._resolve(key)
        if resolved is None:
            return default
        name = self.index[resolved]
        if name not in self._files:
            self._files[name] = torch.load(self.folder / name, map_location="cpu", weights_only=False, mmap=True)
        # a copy in memory: two keys that resolve to one entry (a tied weight's copies) must not
        # share tensors, and nothing may live on in the mapped file
        return copy.deepcopy(self._files[name][resolved])

    def required(self, key: str) -> Any:
        """The entry under `key` (or its tied alias); KeyError naming it when the step lacks it."""
        if self._resolve(key) is None:
            raise KeyError(f"the checkpoint in {self.folder} holds no {key!r}")
        return self.get(key)

    def keys(self, prefix: str = "") -> list[str]:
        """Every key of the step that starts with `prefix`."""
        return [key for key in self.index if key.startswith(prefix)]
