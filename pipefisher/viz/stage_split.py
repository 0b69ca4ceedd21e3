"""Fit a profile of D pipeline stages to a schedule with several model chunks per rank.

A schedule that holds V chunks on each of D ranks (interleaved, V-shape) needs one profile entry
per chunk, V·D in all. `fit_stages` cuts every stage of a D-stage profile into V chunks of equal
compute, in order: chunk j of stage s is model piece s·V + j. Per chunk, forward, backward, its
weight-gradient part, gradient reduction and end of step are the stage's divided by V (their
samples too), the transfer time `p2p` stays (the same activations cross every cut), and the
stage's curvature layers are dealt out in order, whole, round(j·L/V) to round((j+1)·L/V). This
is how `pipefisher.planning.transformer_profile` cuts a model into stages, so a Transformer profile cut
this way equals one built with V·D stages when its blocks divide evenly.
Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from pipefisher.core.profile import Profile, ProfileError, StageProfile

#: stage times that split with the stage's compute (the rest, `p2p`, stays per chunk)
_DIVIDED = ("forward", "backward", "weight", "step_end", "grad_reduce")


def split_stage(stage: StageProfile, parts: int) -> list[StageProfile]:
    """`stage` cut into `parts` chunks of equal compute (see the module docstring)."""
    layers = stage.layers
    samples = {
        name: tuple(v / parts for v in values) if name in _DIVIDED else values for name, values in stage.samples.items()
    }
    return [
        replace(
            stage,
            **{name: getattr(stage, name) / parts for name in _DIVIDED},
            layers=layers[round(j * len(layers) / parts) : round((j + 1) * len(layers) / parts)],
            samples=samples,
        )
        for j in range(parts)
    ]


def fit_stages(profile: Profile, num_stages: int) -> Profile:
    """`profile` itself if it has `num_stages` stages; cut into `num_stages` chunks if that is a
    multiple of its stage count; ProfileError otherwise."""
    have = profile.num_stages
    if num_stages == have:
        return profile
    if num_stages % have:
        raise ProfileError(f"profile has {have} stages but the schedule needs {num_stages}, not a multiple of {have}")
    parts = num_stages // have
    return replace(profile, stages=tuple(chunk for stage in profile.stages for chunk in split_stage(stage, parts)))
