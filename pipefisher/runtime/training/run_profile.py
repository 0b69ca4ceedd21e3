"""A profile file as a curvature run takes it (`<method>.profile`): checked against the run
(`check_profile_matches`), and, where it was measured at another split of the same stages (the
even split, for a run on `pipeline.stage_blocks`, or the reverse), cut by block to the run's split
first (`run_profile`: the planner's `resplit`, as `pipefisher plan` predicts that split from it)."""

from __future__ import annotations

from typing import Any

import torch

from pipefisher.config import RunConfig
from pipefisher.core.profile import Profile, ProfileError
from pipefisher.methods.registry import method_of, method_of_profile
from pipefisher.models import StagedModel
from pipefisher.planning.planner.model_sizes import PlanError, model_sizes
from pipefisher.planning.planner.sources import resplit
from pipefisher.runtime.training.assembly import staged_model


def stage_layer_names(config: RunConfig, stage: int, num_stages: int, model: StagedModel | None = None) -> list[str]:
    """Names of the layers of a stage that the run's curvature method (`method_of`) works on,
    without allocating it (`model`: the run's, if built)."""
    model = model if model is not None else staged_model(config)
    parts = method_of(config).runtime_parts()
    with torch.device("meta"):
        module = model.build_stage(stage, num_stages, config.run.seed)
    return parts.layer_names(module, parts.skip(model))


def run_profile(profile: Profile, config: RunConfig, num_stages: int, model: StagedModel | None = None) -> Profile:
    """`profile`, cut to the run's stage split where it holds the run's layers on as many stages
    split otherwise (module docstring), then checked (`check_profile_matches`: ProfileError naming
    what differs)."""
    model = model if model is not None else staged_model(config)
    expected = [stage_layer_names(config, stage, num_stages, model) for stage in range(num_stages)]
    found = [[layer.name for layer in stage.layers] for stage in profile.stages]
    if found != expected and len(found) == num_stages and sorted(sum(found, [])) == sorted(sum(expected, [])):
        try:
            cut = resplit(profile, num_stages, model_sizes(config), config.pipeline.stage_blocks)
        except (PlanError, ValueError):  # no sizes for the planner: checked as it is
            cut = profile
        if [[layer.name for layer in stage.layers] for stage in cut.stages] == expected:
            profile = cut
    check_profile_matches(profile, config, num_stages, model)
    return profile


#: what a profile records of the run it measured, with the run's key of each
_MEASURED_AT = (
    ("micro_batch_size", "data.micro_batch_size"),
    ("seq_len", "model.seq_len"),
    ("precision", "run.precision"),
    ("model", "model"),
    ("recompute", "model.recompute"),
    ("tf32", "run.tf32"),
)


def _shown(value: Any) -> str:
    """`value` as a run file writes it (booleans lower-case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _run_value(config: RunConfig, key: str) -> Any:
    """The run's value of `key` of `_MEASURED_AT` ("model": its identity)."""
    if key == "model":
        return config.model.identity
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def check_profile_matches(
    profile: Profile, config: RunConfig, num_stages: int, model: StagedModel | None = None
) -> None:
    """Refuse a profile of another run, naming the first field that differs: the curvature
    method, stage count, tensor-parallel degree, layer names, or what it was measured at
    (micro-batch size, sequence length, precision, model, recomputation, TF32; a field the profile
    leaves out is unknown and not checked)."""
    method, timed = method_of(config).name, method_of_profile(profile).name
    if timed != method:
        raise ProfileError(
            f"method: the profile times {timed} tasks but this run uses {method}; "
            "measure a profile of this run with `pipefisher profile`"
        )
    profile.require_stages(num_stages, hint="one entry per model chunk of this run")
    degree = config.pipeline.tensor_parallel
    if profile.tensor_parallel != degree:
        raise ProfileError(
            f"tensor_parallel: the profile times the shards of {profile.tensor_parallel} tensor-parallel processes, "
            f"this run has pipeline.tensor_parallel {degree}; measure a profile of this run with `pipefisher profile`"
        )
    model = model if model is not None else staged_model(config)
    for stage, entry in enumerate(profile.stages):
        expected = stage_layer_names(config, stage, num_stages, model)
        found = [layer.name for layer in entry.layers]
        if found != expected:
            missing = sorted(set(expected) - set(found))
            extra = sorted(set(found) - set(expected))
            raise ProfileError(
                f"stages[{stage}].layers do not match the model: missing {missing[:3]}, unknown {extra[:3]}; "
                "measure a profile of this run with `pipefisher profile`"
            )
    for field, key in _MEASURED_AT:
        measured, here = getattr(profile, field), _run_value(config, key)
        if measured not in (None, "") and measured != here:
            raise ProfileError(
                f"{field}: the profile was measured at {key} {_shown(measured)}, this run has {_shown(here)}; "
                "its times do not hold here: measure a profile of this run with `pipefisher profile`"
            )
