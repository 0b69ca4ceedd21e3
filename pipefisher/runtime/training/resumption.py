"""Which checkpoint a run continues from, and how: what of the configuration must stay (what the
run computes), what may change (how it is laid out), and what does not carry over when it does.

Configuration keys fall in four tiers:

- free (step count, checkpointing, ports, backend, timeouts, bucket size, in-order mode);
- the plan: the curvature method's placement keys, `model.recompute` and `run.compile`. Another
  plan keeps every process's state but not a refresh cycle in progress, nor the profile;
- the processes: schedule, stages, micro-batches, chunks, data parallelism and ZeRO. Other
  processes also lose the random streams and PowerSGD's state;
- the identity: everything else, with the step's micro-batches (`micro_batches × data_parallel`).
  It must stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipefisher.config import RunConfig, config_to_dict
from pipefisher.methods.registry import methods
from pipefisher.runtime.training.checkpoint import FORMAT, MANIFEST, CheckpointError, read_manifest, step_folder, steps, verify

_FREE = {
    ("run", "steps"), ("run", "master_port"), ("run", "master_addr"), ("run", "backend"), ("run", "timeout"), ("run", "metrics"),
    ("run", "bucket_mb"), ("run", "in_order"), ("checkpoint", "dir"), ("checkpoint", "every"), ("checkpoint", "keep"),
    ("checkpoint", "resume"),
}
_PROCESSES = {
    ("pipeline", "schedule"), ("pipeline", "stages"), ("pipeline", "micro_batches"), ("pipeline", "chunks"),
    ("pipeline", "data_parallel"), ("optimizer", "zero"),
}
_PLAN = {("model", "recompute"), ("run", "compile")}
#: keys of the curvature method's section that say where its work runs, not what it computes
_PLACEMENT = {
    "placement", "margin", "percentile", "max_overhead", "max_refresh_steps", "max_capture_mb", "split", "profile", "plan",
    "reprofile_threshold", "reprofile_patience", "grad_worker_fraction",
}


def _tiers(config: RunConfig) -> dict[str, dict[str, Any]]:
    """The run's configuration keys but the free ones as {tier: {"section.key": value}}, tiers
    "identity", "processes" and "plan"; a method's section only for that method's run."""
    method = config.optimizer.name if config.curvature is not None else None
    tiers: dict[str, dict[str, Any]] = {"identity": {}, "processes": {}, "plan": {}}
    for section, values in config_to_dict(config).items():
        if section in methods() and section != method:
            continue
        for key, value in values.items():
            if (section, key) in _FREE:
                continue
            tier = ("processes" if (section, key) in _PROCESSES else
                    "plan" if (section, key) in _PLAN or (section == method and key in _PLACEMENT) else "identity")
            tiers[tier][f"{section}.{key}"] = list(value) if isinstance(value, tuple) else value
    tiers["identity"]["pipeline.step_micro_batches"] = config.pipeline.micro_batches * config.pipeline.data_parallel
    return tiers


def _defaults(config: RunConfig) -> dict[str, dict[str, Any]]:
    """The tiers of the defaults of `config`'s optimizer: what a key added since a checkpoint was
    written counts as."""
    return _tiers(RunConfig().with_overrides(optimizer={"name": config.optimizer.name}))


def manifest_fields(config: RunConfig, cycle: tuple[int, int] | None) -> dict[str, Any]:
    """What a step's manifest says of the run: its identity, processes and plan, and `cycle`, the
    refresh cycle's (position, length) of a curvature run."""
    tiers = _tiers(config)
    return {"config": tiers["identity"], "layout": tiers["processes"], "plan": tiers["plan"],
            "cycle": None if cycle is None else {"position": cycle[0], "refresh_steps": cycle[1]}}


def describe_layout(values: dict[str, Any]) -> str:
    """A layout (a manifest's "layout" and "plan") in a few words, e.g. "chimera, 4 stages × 2
    replicas × 8 micro-batches, ZeRO-1, kfac packed"."""
    def count(key: str, noun: str, nouns: str) -> str:
        return f"{values[key]} {noun if values[key] == 1 else nouns}"

    words = [f"{values['pipeline.schedule']}, {count('pipeline.stages', 'stage', 'stages')} × "
             f"{count('pipeline.data_parallel', 'replica', 'replicas')} × {count('pipeline.micro_batches', 'micro-batch', 'micro-batches')}"]
    if values.get("optimizer.zero"):
        words.append("ZeRO-1")
    words += [f"{key.split('.')[0]} {value}" for key, value in values.items() if key.endswith(".placement")]
    return ", ".join(words)


def resumable_step(directory: str | Path, config: RunConfig) -> tuple[int, list[str]]:
    """The newest step of this configuration whose files all verify, and one line for every newer
    step it skips (why). CheckpointError if there is none, or the newest complete step is of
    another configuration or an older format."""
    directory = Path(directory)
    skipped: list[str] = []
    ours = _tiers(config)["identity"]
    defaults = _defaults(config)["identity"]
    for step, folder in steps(directory):
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
    """How a run continues from a verified step. `same_processes`: its processes hold what they
    held (random streams and PowerSGD's state carry over); `same_plan` as well: everything
    carries over, bit for bit, a refresh cycle in progress and the profile included. `dropped`:
    one phrase per kind of state that does not carry over."""

    step: int
    same_processes: bool
    same_plan: bool
    before: str
    dropped: tuple[str, ...] = ()

    @property
    def same_layout(self) -> bool:
        return self.same_processes and self.same_plan

    def summary(self, fell_back: bool = False) -> str:
        """The line a resumption starts with (`fell_back`: newer steps were skipped)."""
        line = f"resuming from step {self.step}" + (", the newest checkpoint that verifies" if fell_back else "")
        if self.same_layout:
            return line
        return f"{line}, written on {self.before}, on another layout; dropped: {'; '.join(self.dropped)}"


def resumption(directory: str | Path, step: int, config: RunConfig) -> Resumption:
    """How `config` continues from the verified `step` in `directory`."""
    manifest = read_manifest(step_folder(directory, step))
    defaults, ours = _defaults(config), _tiers(config)
    processes = {**defaults["processes"], **manifest["layout"]}
    plan = {**defaults["plan"], **manifest.get("plan", {})}
    before = describe_layout({**processes, **plan})
    same_processes, same_plan = processes == ours["processes"], plan == ours["plan"]
    dropped = []
    if not same_processes:
        dropped.append("the random streams (dropout masks are drawn from streams re-seeded by rank and step)")
        kinds = {kind for entry in manifest["files"].values() for kind in entry["bytes"]}
        if "powersgd" in kinds:
            dropped.append("PowerSGD's error feedback and warm start (compression restarts from zero error and a fresh Q)")
    cycle = manifest.get("cycle")
    if cycle is not None and not (same_processes and same_plan):
        if cycle["position"] != 0:
            dropped.append(
                f"the refresh cycle stopped after step {cycle['position']} of {cycle['refresh_steps']}: its captures and "
                "unfinished refresh results (a new cycle starts; the statistics folded in and the results in use are kept)")
        if not config.section(config.optimizer.name).profile:
            dropped.append("the profile (this run measures its own and packs its own plan)")
    return Resumption(step, same_processes, same_plan, before, tuple(dropped))
