"""A profile measured under a split-backward schedule (`StageProfile.weight` set) times the split's
own cost; the planner takes it for schedules that split the backward (ZB-H1, ZBV, DualPipeV) and a
fused profile for the rest (`MeasuredTimes.profile`, `measured_split`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefisher.config import load_config
from pipefisher.core.profile import Profile, load_profile
from pipefisher.planning.planner.predict import first_order_time
from pipefisher.planning.planner.run_layout import run_layout
from pipefisher.planning.planner.sources import MeasuredTimes, measured_split

PROFILE = "profiles/tiny-cpu-1f1b.yaml"


def _split(profile: Profile, cost: float) -> Profile:
    """`profile` as a split-backward schedule measures it: each stage's backward `cost` x the fused
    one, its weight-gradient part a third of that."""
    stages = tuple(replace(s, backward=s.backward * cost, weight=s.backward * cost / 3) for s in profile.stages)
    return replace(profile, stages=stages)


def _context(*profiles: Profile, schedule: str = "zb-h1"):
    config = load_config("schedules/tiny-cpu.yaml").with_overrides(pipeline={"schedule": schedule})
    layout, context = run_layout(config, profiles[0], PROFILE)
    source = MeasuredTimes.check([(f"p{i}", p) for i, p in enumerate(profiles)], context.sizes, None)
    return layout, replace(context, source=source)


@pytest.mark.parametrize("fused_first", [True, False])
def test_each_schedule_takes_the_profile_measured_its_way(fused_first: bool) -> None:
    fused = load_profile(PROFILE)
    split = _split(fused, 1.25)
    assert (measured_split(fused), measured_split(split)) == (False, True)
    _, context = _context(*((fused, split) if fused_first else (split, fused)))
    pieces, size = fused.num_stages, fused.micro_batch_size
    assert context.source.profile(pieces, size, 1, split_backward=True) == split
    assert context.source.profile(pieces, size, 1, split_backward=False) == fused


def test_a_split_profile_moves_the_zero_bubble_prediction_only() -> None:
    fused = load_profile(PROFILE)
    split = _split(fused, 1.25)
    zero_bubble, alone = _context(fused, schedule="zb-h1")
    _, both = _context(fused, split, schedule="zb-h1")
    assert first_order_time(zero_bubble, both)[0] > first_order_time(zero_bubble, alone)[0]  # the split costs more
    one_f_one_b, alone = _context(fused, schedule="1f1b")
    _, both = _context(fused, split, schedule="1f1b")
    assert first_order_time(one_f_one_b, both) == first_order_time(one_f_one_b, alone)


def test_a_lone_profile_serves_every_schedule() -> None:
    split = _split(load_profile(PROFILE), 1.25)
    _, context = _context(split, schedule="1f1b")
    assert context.source.profile(split.num_stages, split.micro_batch_size, 1, split_backward=False) == split
