"""Checkpoints: one file per process per saved step, a manifest that makes the step complete, and
a resume that verifies before it trusts.

Layout: ``DIR/step-000006/rank-0.pt`` …, ``DIR/step-000006/manifest.json`` and ``DIR/latest`` (the
newest step, for people). A process's file is a dict of entries under layout-free keys
(`pipefisher.runtime.training.checkpoint_state`): each entry is written once, by the lowest process
holding it. The manifest (format 2) holds the configuration that must stay (`identity`), the
layout that may change (`layout`), the refresh cycle's position, and every file's size, SHA-256,
keys and bytes per kind. A process writes its file to a temporary name, flushes it to disk, hashes
what is on disk and renames it into place; process 0 writes the manifest (atomically) only after
every process has, so a step without a manifest is incomplete. Resuming takes the newest step
whose manifest is of this configuration and whose files all verify, names every newer one it
skips and why; each process then reads the entries it needs (memory-mapped: nothing else).
Pruning keeps the `keep` newest complete steps of the run's own history and never the new one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipefisher.config import RunConfig, config_to_dict
from pipefisher.core.files import write_atomically
from pipefisher.methods.registry import methods

#: the manifest format this code writes and reads (1: the per-layout files before it, no field)
FORMAT = 2
#: configuration keys that may change between a run and its resumption
_FREE = {
    ("run", "steps"), ("run", "master_port"), ("run", "master_addr"), ("run", "backend"), ("run", "timeout"), ("run", "metrics"),
    ("run", "bucket_mb"), ("run", "in_order"), ("checkpoint", "dir"), ("checkpoint", "every"), ("checkpoint", "keep"),
    ("checkpoint", "resume"),
}
#: keys that say how the run is laid out, not what it computes: a checkpoint resumes on any of them
#: (pipeline.micro_batches × pipeline.data_parallel, the step's micro-batches, must stay)
_LAYOUT = {
    ("pipeline", "schedule"), ("pipeline", "stages"), ("pipeline", "micro_batches"), ("pipeline", "chunks"),
    ("pipeline", "data_parallel"), ("optimizer", "zero"), ("model", "recompute"), ("run", "compile"),
}
#: keys of the curvature method's section that say where its work runs, not what it computes
_PLACEMENT = {
    "placement", "margin", "percentile", "max_overhead", "max_refresh_steps", "max_capture_mb", "split", "profile", "plan",
    "reprofile_threshold", "reprofile_patience", "grad_worker_fraction",
}
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


def _sections(config: RunConfig) -> dict[tuple[str, str], Any]:
    """Every configuration key of the run's sections but the free ones, as {(section, key): value}."""
    method = config.optimizer.name if config.curvature is not None else None
    flat = {}
    for section, values in config_to_dict(config).items():
        if section in methods() and section != method:
            continue  # a method's section matters only to its run
        for key, value in values.items():
            if (section, key) not in _FREE:
                flat[(section, key)] = list(value) if isinstance(value, tuple) else value
    return flat


def _is_layout(config: RunConfig, section: str, key: str) -> bool:
    return (section, key) in _LAYOUT or (config.curvature is not None and section == config.optimizer.name and key in _PLACEMENT)


def identity(config: RunConfig) -> dict[str, Any]:
    """The keys a resumed run must share (what it computes), as a flat {"section.key": value} dict."""
    flat = {f"{section}.{key}": value for (section, key), value in _sections(config).items() if not _is_layout(config, section, key)}
    flat["pipeline.step_micro_batches"] = config.pipeline.micro_batches * config.pipeline.data_parallel
    return flat


def layout(config: RunConfig) -> dict[str, Any]:
    """The keys a resumed run may change (how it is laid out), as a flat {"section.key": value} dict."""
    return {f"{section}.{key}": value for (section, key), value in _sections(config).items() if _is_layout(config, section, key)}


def describe_layout(values: dict[str, Any]) -> str:
    """A layout (`layout`) in a few words, e.g. "chimera, 4 stages × 2 replicas, ZeRO-1"."""
    def count(key: str, noun: str, nouns: str) -> str:
        return f"{values[key]} {noun if values[key] == 1 else nouns}"

    words = [f"{values['pipeline.schedule']}, {count('pipeline.stages', 'stage', 'stages')} × {count('pipeline.data_parallel', 'replica', 'replicas')}"
             f" × {count('pipeline.micro_batches', 'micro-batch', 'micro-batches')}"]
    if values.get("optimizer.zero"):
        words.append("ZeRO-1")
    words += [f"{key.split('.')[0]} {value}" for key, value in values.items() if key.endswith(".placement")]
    return ", ".join(words)


def kind_of(key: str) -> str:
    """The kind of an entry's key: its first part (model, optimizer, curvature, run), or for a
    process's own state (``local/<process>/<kind>/…``) that kind (rng, powersgd, cycle)."""
    parts = key.split("/")
    return parts[2] if parts[0] == "local" else parts[0]


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


def commit(directory: str | Path, step: int, config: RunConfig, records: list[FileRecord], keep: int = 2,
           cycle: tuple[int, int] | None = None) -> None:
    """Process 0, once every process saved `step`: write its manifest (`cycle`: the refresh
    cycle's (position, length) of a curvature run), point `latest` at it, and prune: later steps
    (another history, e.g. after resuming from an earlier step) and complete steps beyond the
    `keep` newest go; an incomplete step older than the kept ones goes too."""
    directory = Path(directory)
    folder = step_folder(directory, step)
    for record in records:
        size = (folder / record.name).stat().st_size
        if size != record.size:
            raise CheckpointError(f"{folder / record.name}: {size} bytes on disk, {record.size} written; checkpoint not committed")
    manifest = {
        "format": FORMAT, "step": step, "config": identity(config), "layout": layout(config),
        "cycle": None if cycle is None else {"position": cycle[0], "refresh_steps": cycle[1]},
        "files": {r.name: {"size": r.size, "sha256": r.sha256, "bytes": dict(r.kind_bytes), "keys": list(r.keys)} for r in records},
    }
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


def resumable_step(directory: str | Path, config: RunConfig) -> tuple[int, list[str]]:
    """The newest step of this configuration whose files all verify, and one line for every newer
    step it skips (why). CheckpointError if there is none, or the newest complete step is of
    another configuration or an older format."""
    directory = Path(directory)
    skipped: list[str] = []
    ours = identity(config)
    defaults = identity(RunConfig())  # keys added since a checkpoint was written
    for step, folder in _steps(directory):
        try:
            manifest = read_manifest(folder)
        except FileNotFoundError:
            skipped.append(f"step {step}: incomplete (no {MANIFEST}: stopped while saving)")
            continue
        except (OSError, ValueError):
            skipped.append(f"step {step}: {folder / MANIFEST} is unreadable")
            continue
        if manifest.get("format") != FORMAT:
            raise CheckpointError(
                f"{folder} is a checkpoint of format {manifest.get('format', 1)}, written before layout-free checkpoints "
                f"(format {FORMAT}); this pipefisher cannot read it: resume it with the version that wrote it, or start afresh "
                "with checkpoint.resume: never and another checkpoint.dir")
        theirs = {**defaults, **manifest.get("config", {})}
        differing = next((key for key in sorted(set(ours) | set(theirs)) if theirs.get(key) != ours.get(key)), None)
        if differing is not None:
            raise CheckpointError(
                f"the checkpoint in {directory} is from another configuration: {differing} is "
                f"{theirs.get(differing)!r} there and {ours.get(differing)!r} here; set {differing}: {theirs.get(differing)!r} to resume it"
            )
        problem = verify(folder, manifest)
        if problem is None:
            return step, skipped
        skipped.append(f"step {step}: {problem}")
    reason = "; ".join(skipped) if skipped else "no step folders"
    raise CheckpointError(f"no checkpoint in {directory} to resume from ({reason})")


@dataclass(frozen=True)
class Resumption:
    """How a run continues from a verified step: on the layout that wrote it (everything carries
    over, bit for bit) or on another, with one line per kind of state that does not carry over."""

    step: int
    same_layout: bool
    before: str
    dropped: tuple[str, ...] = ()

    def summary(self, fell_back: bool = False) -> str:
        """The line a resumption starts with (`fell_back`: newer steps were skipped)."""
        line = f"resuming from step {self.step}" + (", the newest checkpoint that verifies" if fell_back else "")
        if self.same_layout:
            return line
        return f"{line}, written on {self.before}, on another layout; dropped: {'; '.join(self.dropped)}"


def resumption(directory: str | Path, step: int, config: RunConfig) -> Resumption:
    """How `config` continues from the verified `step` in `directory` (CheckpointError: it cannot)."""
    manifest = read_manifest(step_folder(directory, step))
    before = describe_layout(manifest["layout"])
    if manifest["layout"] == layout(config):
        return Resumption(step, True, before)
    kinds = {kind for entry in manifest["files"].values() for kind in entry["bytes"]}
    dropped = ["the random streams (dropout masks are drawn from streams re-seeded by rank and step)"]
    if "powersgd" in kinds:
        dropped.append("PowerSGD's error feedback and warm start (compression restarts from zero error and a fresh Q)")
    cycle = manifest.get("cycle")
    if cycle is not None and cycle["position"] != 0:
        dropped.append(
            f"the refresh cycle stopped after step {cycle['position']} of {cycle['refresh_steps']}: its captures and "
            "unfinished refresh results (a new cycle starts; the statistics folded in and the results in use are kept)")
    return Resumption(step, False, before, tuple(dropped))


class StateReader:
    """The entries of a step (verified by `resumable_step`), read on demand: each file is
    memory-mapped once, so only the entries asked for are read. `aliases`: a tied weight's name
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
        return self._files[name][resolved]

    def keys(self, prefix: str = "") -> list[str]:
        """Every key of the step that starts with `prefix`."""
        return [key for key in self.index if key.startswith(prefix)]
