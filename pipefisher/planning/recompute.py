"""The cost of activation recomputation (`model.recompute`) in a profile: a profile measured without
it turned into the one predicted with it. Pure Python (no torch).

Recomputing runs part of a stage's forward again inside its backward, once per micro-batch, before
the input gradient: the stage's `backward` grows by that part of its `forward`; the weight gradient
(op W of zero-bubble schedules) does not recompute and keeps its time.

What part (`recompute_forward_share`), by forward flops per sequence of `seq_len` tokens, width
`hidden`, feed-forward width `ffn` (the time is assumed to split like the flops):

- a block's Linear layers: 2·s·(4h² + 2h·ffn) (query, key, value, output; the two FFN layers);
- its attention core: 4·s²·h (scores q·kᵀ and context p·v, 2·s²·h each; softmax and dropout
  are not counted);
- `blocks` recomputes the blocks (everything but embeddings and heads, whose flops the caller
  gives as `other_flops`; 0 treats the whole forward as blocks, exact for a middle stage);
- `selective` recomputes the attention cores only. Cores are memory-bound kernels that run below
  the matmuls' flop rate, so the predicted share is a lower bound where s is small against h.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipefisher.core.profile import RECOMPUTE_MODES, Profile, ProfileError, Samples, StageProfile


def block_flops(hidden: int, ffn: int, seq_len: int) -> tuple[float, float]:
    """(Linear flops, attention-core flops) of one Transformer block's forward, per sequence."""
    linear = 2.0 * seq_len * (4 * hidden * hidden + 2 * hidden * ffn)
    core = 4.0 * seq_len * seq_len * hidden
    return linear, core


def recompute_forward_share(
    mode: str, hidden: int, ffn: int, seq_len: int, blocks: int, other_flops: float = 0.0
) -> float:
    """The share of a stage's forward that `mode` recomputes in its backward: the stage holds
    `blocks` Transformer blocks and parts outside them of `other_flops` forward flops per sequence
    (embeddings, final norm, heads). 0 for none; ValueError naming a bad argument."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    for name, value in (("hidden", hidden), ("ffn", ffn), ("seq_len", seq_len)):
        if value < 1:
            raise ValueError(f"{name}: {value} must be a positive integer")
    if blocks < 0 or other_flops < 0:
        raise ValueError(f"blocks {blocks} and other_flops {other_flops} must not be negative")
    linear, core = block_flops(hidden, ffn, seq_len)
    total = blocks * (linear + core) + other_flops
    recomputed = {"none": 0.0, "selective": blocks * core, "blocks": blocks * (linear + core)}[mode]
    return recomputed / total if total else 0.0


def with_recompute(profile: Profile, mode: str, forward_share: Sequence[float]) -> Profile:
    """`profile` (measured without recomputation) as predicted with `model.recompute` `mode`:
    stage i's backward (and each of its backward samples) grows by forward_share[i] × its forward
    (`recompute_forward_share`); the weight-gradient part keeps its time (a `weight` left unknown,
    half of the old backward, is written out). ProfileError for a profile that already has
    recomputation, ValueError for shares that are not one per stage in [0, 1]."""
    if profile.recompute != "none":
        raise ProfileError(
            f"recompute: the profile was measured with model.recompute {profile.recompute}; "
            "give one measured with model.recompute none"
        )
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if len(forward_share) != profile.num_stages or not all(0.0 <= share <= 1.0 for share in forward_share):
        raise ValueError(
            f"forward_share: {list(forward_share)} must hold one share in [0, 1] per stage ({profile.num_stages})"
        )
    if mode == "none":
        return profile
    stages = tuple(_recomputing(stage, share) for stage, share in zip(profile.stages, forward_share))
    return replace(profile, stages=stages, recompute=mode)


def _recomputing(stage: StageProfile, share: float) -> StageProfile:
    extra = share * stage.forward
    samples = dict(stage.samples)
    if "backward" in samples:
        samples["backward"] = tuple(value + extra for value in samples["backward"])
    return replace(stage, backward=stage.backward + extra, weight=stage.weight_gradient, samples=Samples(samples))
