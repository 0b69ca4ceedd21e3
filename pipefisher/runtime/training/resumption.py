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

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import json

import yaml

from pipefisher.config import ConfigError, RunConfig, config_to_dict
from pipefisher.core.ir import ScheduleError
from pipefisher.methods.registry import methods
from pipefisher.models.registry import kinds
from pipefisher.runtime.training.checkpoint import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    read_manifest,
    set_aside,
    step_folder,
    step_problem,
    steps,
)
from pipefisher.schedules import chunks_per_rank, get_schedule
from pipefisher.schedules.validate import validate

_FREE = {
    ("run", "steps"),
    ("run", "time_budget_s"),
    ("run", "master_port"),
    ("run", "master_addr"),
    ("run", "backend"),
    ("run", "timeout"),
    ("run", "metrics"),
    ("run", "bucket_mb"),
    ("run", "in_order"),
    ("checkpoint", "dir"),
    ("checkpoint", "every"),
    ("checkpoint", "keep"),
    ("checkpoint", "resume"),
    ("data", "shards"),  # where the folder lies; what it holds is checked by its checksum (`data_problem`)
}
_PROCESSES = {
    ("pipeline", "schedule"),
    ("pipeline", "stages"),
    ("pipeline", "micro_batches"),
    ("pipeline", "chunks"),
    ("pipeline", "stage_blocks"),
    ("pipeline", "data_parallel"),
    ("optimizer", "zero"),
}
#: the identity's count of a step's micro-batches (over all replicas): not a key, the advice sets keys
STEP_MICRO_BATCHES = "pipeline.step_micro_batches"
_PLAN = {("model", "recompute"), ("run", "compile")}
#: keys of the curvature method's section that say where its work runs, not what it computes
_PLACEMENT = {
    "placement",
    "margin",
    "percentile",
    "max_overhead",
    "max_refresh_steps",
    "max_capture_mb",
    "split",
    "helpers",
    "profile",
    "plan",
    "reprofile_threshold",
    "reprofile_patience",
    "grad_worker_fraction",
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
            tier = (
                "processes"
                if (section, key) in _PROCESSES
                else "plan"
                if (section, key) in _PLAN or (section == method and key in _PLACEMENT)
                else "identity"
            )
            tiers[tier][f"{section}.{key}"] = list(value) if isinstance(value, tuple) else value
    tiers["identity"][STEP_MICRO_BATCHES] = config.pipeline.micro_batches * config.pipeline.data_parallel
    return tiers


def _defaults(optimizer: str) -> dict[str, dict[str, Any]]:
    """The tiers of the defaults of a run of `optimizer` (of the default optimizer when that one is
    not registered here): what a key added since a checkpoint was written counts as."""
    try:
        return _tiers(RunConfig().with_overrides(optimizer={"name": optimizer}))
    except ConfigError:
        return _tiers(RunConfig())


def manifest_fields(config: RunConfig, cycle: tuple[int, int] | None, step: int = 0) -> dict[str, Any]:
    """What a step's manifest says of the run: its identity, processes and plan, `cycle`, the
    refresh cycle's (position, length) of a curvature run, and after `step` steps of a run
    reading shards its data position (`pipefisher.data.shards.position`)."""
    tiers = _tiers(config)
    fields = {
        "config": tiers["identity"],
        "layout": tiers["processes"],
        "plan": tiers["plan"],
        "cycle": None if cycle is None else {"position": cycle[0], "refresh_steps": cycle[1]},
    }
    if config.data.kind == "shards":
        fields["data"] = _data_position(config, step).to_dict()
    return fields


def _data_position(config: RunConfig, step: int):
    """The shard position of `config`'s run after `step` steps."""
    from pipefisher.data.shards.position import data_position

    data, pipeline = config.data, config.pipeline
    samples = step * pipeline.micro_batches * pipeline.data_parallel * data.micro_batch_size
    return data_position(data.shards, data.seed, samples)


def data_problem(manifest: dict[str, Any], config: RunConfig) -> str:
    """Why `config`'s run cannot continue from the step of `manifest` with its shards (they changed,
    or its position differs), in one line naming data.shards; "" when it can or reads no shards."""
    if config.data.kind != "shards":
        return ""
    from pipefisher.data.shards.format import ShardError
    from pipefisher.data.shards.position import position_problem

    try:
        current = _data_position(config, manifest["step"])
    except ShardError as exc:
        return f"data.shards: {exc}"
    problem = position_problem(manifest.get("data"), current, config.data.shards)
    return f"data.shards: {problem}" if problem else ""


def describe_layout(values: dict[str, Any]) -> str:
    """A layout (a manifest's "layout" and "plan") in a few words, e.g. "chimera, 4 stages × 2
    replicas × 8 micro-batches, ZeRO-1, kfac packed"."""

    def count(key: str, noun: str, nouns: str) -> str:
        return f"{values[key]} {noun if values[key] == 1 else nouns}"

    words = [
        f"{values['pipeline.schedule']}, {count('pipeline.stages', 'stage', 'stages')} × "
        f"{count('pipeline.data_parallel', 'replica', 'replicas')} × {count('pipeline.micro_batches', 'micro-batch', 'micro-batches')}"
    ]
    if values.get("optimizer.zero"):
        words.append(f"ZeRO-{values['optimizer.zero']}")
    words += [f"{key.split('.')[0]} {value}" for key, value in values.items() if key.endswith(".placement")]
    return ", ".join(words)


def resumable_step(directory: str | Path, config: RunConfig, writer: bool = False) -> tuple[int, list[str]]:
    """The newest step of this configuration whose files all verify, and one line for every newer
    step it skips (why). `writer`: the caller holds the folder (`checkpoint_lock`) and continues
    from the step found, so each newer complete step that does not verify is set aside
    (`set_aside`, its line says where) rather than left to be counted or chosen; nothing is moved
    when no step is found. CheckpointError if there is none, or the newest complete step is of
    another model, another configuration (saying which keys to set to resume it) or an older format."""
    directory = Path(directory)
    skipped: list[str] = []
    corrupt: dict[int, tuple[Path, int, str]] = {}  # index in skipped -> the step's (folder, step, problem)
    for step, folder in steps(directory):
        try:
            manifest = read_manifest(folder)
        except FileNotFoundError:
            skipped.append(f"step {step}: incomplete (no {MANIFEST}: stopped while saving)")
            continue
        except (OSError, ValueError):
            pass  # step_problem says it is unreadable
        else:
            _check_identity(directory, folder, manifest, config)
        problem = step_problem(folder)
        if problem is None:
            for index, (path, other, why) in corrupt.items() if writer else ():
                skipped[index] = set_aside(path, other, why)
            return step, skipped
        corrupt[len(skipped)] = (folder, step, problem)
        skipped.append(f"step {step}: {problem}")
    reason = "; ".join(skipped) if skipped else "no step folders"
    raise CheckpointError(f"no checkpoint in {directory} to resume from ({reason})")


def _check_identity(directory: Path, folder: Path, manifest: dict, config: RunConfig) -> None:
    """CheckpointError unless `config` computes what the step's `manifest` was written by."""
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{folder} is a checkpoint of format {manifest.get('format', 1)}, written before layout-free checkpoints "
            f"(format {FORMAT}); this pipefisher cannot read it: resume it with the version that wrote it, or start afresh "
            "with checkpoint.resume: never and another checkpoint.dir"
        )
    ours = _tiers(config)["identity"]
    written = manifest.get("config", {})
    theirs = {**_defaults(written.get("optimizer.name", config.optimizer.name))["identity"], **written}
    if theirs == ours:
        return
    if any(theirs.get(key) != ours.get(key) for key in _model_keys(ours)):
        raise CheckpointError(
            f"the checkpoint in {directory} is of another model ({describe_model(theirs)}, {theirs.get('data.kind')} data there; "
            f"{describe_model(ours)}, {ours.get('data.kind')} data here); resume it with its own run file or give another --checkpoint-dir"
        )
    advice = _advice(config, theirs, manifest["layout"])
    differing = [key for key in sorted(set(ours) | set(theirs)) if theirs.get(key) != ours.get(key)]
    named = [key for key in differing if advice is None or key in advice or key == STEP_MICRO_BATCHES]  # the causes
    differences = "; ".join(_difference(key, theirs, ours, manifest["layout"], config) for key in named)
    fix = (
        "set " + ", ".join(f"{key}: {_yaml(value)}" for key, value in advice.items()) + " to resume it"
        if advice is not None
        else "no setting of this run file makes it resume: resume it with its own run file or give another --checkpoint-dir"
    )
    raise CheckpointError(f"the checkpoint in {directory} is from another configuration: {differences}; {fix}")


def _naming_keys(values: dict[str, Any]) -> tuple[str, ...]:
    """The keys that name the model of a manifest's "config" (its kind's `naming_keys`; none for a
    kind this process does not know): another value is another model, not a setting to change."""
    kind = kinds().get(values.get("model.kind", ""))
    return tuple(f"model.{key}" for key in kind.naming_keys) if kind is not None else ()


def _model_keys(identity: dict[str, Any]) -> tuple[str, ...]:
    """The identity keys that say which model a run trains (its kind, its data's kind, and the
    keys naming it); a checkpoint that differs in one is of another model."""
    return ("model.kind", "data.kind", *_naming_keys(identity))


def describe_model(values: dict[str, Any]) -> str:
    """A model of a manifest's "config" in words: its kind and the value of its first naming key
    ("hf gpt2-tiny", "bert bert-tiny"), or its blocks and width ("transformer: 4 blocks of width 32")."""
    kind, naming = values.get("model.kind", "?"), _naming_keys(values)
    if naming:
        return f"{kind} {values.get(naming[0])}"
    return f"{kind}: {values.get('model.layers')} blocks of width {values.get('model.hidden')}"


def _difference(
    key: str, theirs: dict[str, Any], ours: dict[str, Any], layout: dict[str, Any], config: RunConfig
) -> str:
    """One identity key that differs, in words."""
    if key != STEP_MICRO_BATCHES:
        return f"{key} is {_yaml(theirs.get(key))} there and {_yaml(ours.get(key))} here"
    return (
        f"the checkpoint's step takes {theirs.get(key)} micro-batches (pipeline.micro_batches {layout['pipeline.micro_batches']} × "
        f"pipeline.data_parallel {layout['pipeline.data_parallel']}); here {ours.get(key)} (pipeline.micro_batches "
        f"{config.pipeline.micro_batches} × pipeline.data_parallel {config.pipeline.data_parallel})"
    )


def _yaml(value: Any) -> str:
    """`value` as a run file and --SECTION.KEY read it back."""
    if isinstance(value, str) and value and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)


def _advice(config: RunConfig, theirs: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any] | None:
    """The keys ("section.key" -> value) to set in `config` for its identity to be `theirs` and its
    schedule valid, as few as found; None if none is found. The step's micro-batches are matched
    by this run's micro-batches, else the checkpoint's micro-batches and replicas, else its layout."""
    ours = _tiers(config)["identity"]
    keys = [
        key for key in sorted(set(ours) | set(theirs)) if key != STEP_MICRO_BATCHES and theirs.get(key) != ours.get(key)
    ]
    for pipeline in _layouts(config, theirs[STEP_MICRO_BATCHES], layout):
        advice = {key: theirs.get(key) for key in keys} | pipeline
        if not _resumes(config, advice, theirs):
            continue
        for key in keys:  # the fewest: drop each key the others already bring
            fewer = {k: v for k, v in advice.items() if k != key}
            if _resumes(config, fewer, theirs):
                advice = fewer
        return advice
    return None


def _layouts(config: RunConfig, step_micro_batches: int, layout: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The pipeline keys to try for a step of `step_micro_batches` (none when it is the run's)."""
    replicas = config.pipeline.data_parallel
    if config.pipeline.micro_batches * replicas == step_micro_batches:
        yield {}
        return
    if step_micro_batches % replicas == 0:
        yield {"pipeline.micro_batches": step_micro_batches // replicas}
    yield {key: layout[key] for key in ("pipeline.micro_batches", "pipeline.data_parallel")}
    yield {key: value for key, value in layout.items() if key.startswith("pipeline.")}


def _resumes(config: RunConfig, advice: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Whether `config` with `advice` applied has the identity `theirs` and a valid schedule."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in advice.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = tuple(value) if isinstance(value, list) else value
    try:
        advised = config.with_overrides(**sections)
        pipeline = advised.pipeline
        validate(
            get_schedule(
                pipeline.schedule,
                pipeline.stages,
                pipeline.micro_batches,
                chunks_per_rank(pipeline.schedule, pipeline.chunks),
            )
        )
    except (ConfigError, ScheduleError, KeyError):
        return False
    return _tiers(advised)["identity"] == theirs


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
    problem = data_problem(manifest, config)
    if problem:
        raise CheckpointError(f"cannot resume from step {step} in {directory}: {problem}")
    defaults, ours = _defaults(config.optimizer.name), _tiers(config)
    processes = {**defaults["processes"], **manifest["layout"]}
    plan = {**defaults["plan"], **manifest.get("plan", {})}
    before = describe_layout({**processes, **plan})
    same_processes, same_plan = processes == ours["processes"], plan == ours["plan"]
    dropped = []
    if not same_processes:
        dropped.append("the random streams (dropout masks are drawn from streams re-seeded by rank and step)")
        kinds = {kind for entry in manifest["files"].values() for kind in entry["bytes"]}
        if "powersgd" in kinds:
            dropped.append(
                "PowerSGD's error feedback and warm start (compression restarts from zero error and a fresh Q)"
            )
    cycle = manifest.get("cycle")
    if cycle is not None and not (same_processes and same_plan):
        if cycle["position"] != 0:
            dropped.append(
                f"the refresh cycle stopped after step {cycle['position']} of {cycle['refresh_steps']}: its captures and "
                "unfinished refresh results (a new cycle starts; the statistics folded in and the results in use are kept)"
            )
        if not config.section(config.optimizer.name).profile:
            dropped.append("the profile (this run measures its own and packs its own plan)")
    return Resumption(step, same_processes, same_plan, before, tuple(dropped))
