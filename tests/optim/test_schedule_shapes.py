"""Cosine, polynomial and warm-up–stable–decay schedules against closed forms in float64 and
torch's CosineAnnealingLR; the run file's keys (defaults, refusals) and a curvature run's two
rates; resuming a schedule part way."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from builders import tiny_model
from pipefisher.config import ConfigError, config_from_dict
from pipefisher.models.tiny import TinyRegression
from pipefisher.optim.schedule import WarmupDecay, warmup_decay
from pipefisher.runtime.training.optimizer import build_optimizer, build_scheduler, schedule_of
from pipefisher.runtime.training.trainer import method_skip


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _sgd(*rates: float) -> torch.optim.SGD:
    return torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": lr} for lr in rates])


def _rates(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list:
    """The groups' rates at optimizer steps 0 .. steps − 1."""
    seen = []
    for _ in range(steps):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return seen


def _cosine(step: int, start: int, end: int, floor: float) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (step - start) / (end - start)))


@pytest.mark.parametrize(
    "schedule, expected",
    [
        # cosine: warm-up 10 of 110, floor 0.1; half-way the rate is the mean of 1 and the floor
        (
            WarmupDecay(10, 110, final_fraction=0.1, shape="cosine"),
            {5: 0.5, 10: 1.0, 35: _cosine(35, 10, 110, 0.1), 60: 0.55, 109: _cosine(109, 10, 110, 0.1), 110: 0.1},
        ),
        # polynomial power 2 with a floor
        (WarmupDecay(0, 100, power=2.0, final_fraction=0.2), {0: 1.0, 50: 0.2 + 0.8 * 0.25, 90: 0.2 + 0.8 * 0.01}),
        # WSD, linear: 100 steps, the last 20 decay; the rate holds at 1 through step 80
        (
            WarmupDecay(10, 100, decay_fraction=0.2),
            {5: 0.5, 10: 1.0, 50: 1.0, 80: 1.0, 85: 0.75, 90: 0.5, 99: 0.05, 100: 0.0, 1000: 0.0},
        ),
        # WSD, cosine with floor 0.1 over the last 30 of 60
        (
            WarmupDecay(0, 60, final_fraction=0.1, shape="cosine", decay_fraction=0.5),
            {0: 1.0, 30: 1.0, 45: 0.55, 40: _cosine(40, 30, 60, 0.1), 60: 0.1},
        ),
        # WSD, 1 − sqrt: a quarter of the way the rate has lost half
        (WarmupDecay(0, 50, shape="sqrt", decay_fraction=0.8), {10: 1.0, 20: 0.5, 30: 1 - math.sqrt(0.5), 50: 0.0}),
        # WSD whose decay would reach into the warm-up starts at the warm-up's end
        (WarmupDecay(8, 10, decay_fraction=0.5), {4: 0.5, 8: 1.0, 9: 0.5}),
        # constant: the floor is not read
        (WarmupDecay(4, 10, final_fraction=0.3, shape="constant"), {2: 0.5, 4: 1.0, 9: 1.0, 50: 1.0}),
    ],
)
def test_multipliers_follow_the_closed_forms(schedule: WarmupDecay, expected: dict[int, float]) -> None:
    for step, value in expected.items():
        assert schedule(step) == pytest.approx(value, rel=1e-12, abs=1e-12), step


@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_cosine_without_warm_up_is_torchs_cosine_annealing(floor: float) -> None:
    ours, theirs = _sgd(0.3, 2.0), _sgd(0.3, 2.0)
    # CosineAnnealingLR has one eta_min for every group: give the floor of the first
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(theirs, T_max=40, eta_min=floor * 0.3)
    mine = warmup_decay(ours, 0, 40, final_fraction=floor, shape="cosine")
    ours_rates, their_rates = _rates(ours, mine, 41), _rates(theirs, reference, 41)
    assert [rates[0] for rates in ours_rates] == pytest.approx([rates[0] for rates in their_rates], rel=1e-9, abs=1e-12)


def _config(**optimizer) -> object:
    return config_from_dict(
        {
            "model": tiny_model(),
            "optimizer": {"name": "kfac", "lr": 0.005, **optimizer},
            "kfac": {"lr": 0.02},
            "run": {"steps": 20},
        }
    )


def test_a_curvature_run_scales_the_methods_rate_and_the_rests_by_the_wsd_multiplier() -> None:
    config = _config(warmup_steps=2, decay="wsd", decay_fraction=0.5, wsd_shape="cosine", min_lr_fraction=0.1)
    model = TinyRegression(config.model)
    modules = [model.build_stage(index, 2, seed=0) for index in range(2)]
    optimizer = build_optimizer(config, modules, skip=method_skip(config, model))
    scheduler = build_scheduler(config, optimizer)
    expected = {0: 0.0, 1: 0.5, 2: 1.0, 9: 1.0, 10: 1.0, 15: _cosine(15, 10, 20, 0.1), 19: _cosine(19, 10, 20, 0.1)}
    seen = {}
    for step in range(20):
        seen[step] = {name: [group["lr"] for group in part.param_groups] for name, part in optimizer.parts.items()}
        optimizer.step()
        scheduler.step()
    for step, multiplier in expected.items():
        assert seen[step]["method"] == pytest.approx([0.02 * multiplier] * 2, abs=1e-15), step
        assert seen[step]["rest"] == pytest.approx([0.005 * multiplier] * len(seen[step]["rest"]), abs=1e-15), step


@pytest.mark.parametrize(
    "optimizer, schedule",
    [
        ({}, None),
        ({"warmup_steps": 3}, WarmupDecay(3, 20, shape="constant")),
        ({"decay": "linear", "decay_steps": 12}, WarmupDecay(0, 12)),
        ({"decay": "polynomial", "decay_power": 2.0, "min_lr_fraction": 0.05}, WarmupDecay(0, 20, 2.0, 0.05)),
        ({"decay": "cosine", "warmup_steps": 50}, WarmupDecay(20, 20, shape="cosine")),
        ({"decay": "wsd"}, WarmupDecay(0, 20, decay_fraction=0.2)),
        ({"decay": "wsd", "wsd_shape": "sqrt"}, WarmupDecay(0, 20, shape="sqrt", decay_fraction=0.2)),
    ],
)
def test_the_run_files_keys_make_the_schedule(optimizer: dict, schedule: WarmupDecay | None) -> None:
    assert schedule_of(_config(**optimizer)) == schedule


@pytest.mark.parametrize(
    "optimizer, message",
    [
        ({"decay": "cosine", "decay_fraction": 0.5}, "optimizer.decay_fraction: read by optimizer.decay wsd;"),
        ({"decay": "linear", "decay_power": 2.0}, "optimizer.decay_power: read by optimizer.decay polynomial;"),
        ({"wsd_shape": "cosine"}, "optimizer.wsd_shape: read by optimizer.decay wsd; this run's decay is constant"),
        ({"min_lr_fraction": 0.1}, "optimizer.min_lr_fraction: read by optimizer.decay linear or polynomial or"),
        ({"decay": "cosin"}, "optimizer.decay: 'cosin' is not one of constant, linear, polynomial, cosine, wsd"),
        ({"decay": "wsd", "decay_fraction": 0.0}, "optimizer.decay_fraction: 0 must be in (0, 1]"),
        ({"decay": "cosine", "min_lr_fraction": 1.5}, "optimizer.min_lr_fraction: 1.5 must be in [0, 1]"),
        ({"decay": "wsd", "wsd_shape": "exp"}, "optimizer.wsd_shape: 'exp' is not one of linear, cosine, sqrt"),
    ],
)
def test_bad_schedule_keys_are_refused_in_one_line_naming_the_key(optimizer: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        _config(**optimizer)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "schedule",
    [WarmupDecay(2, 12, shape="cosine", final_fraction=0.1), WarmupDecay(1, 12, shape="sqrt", decay_fraction=0.5)],
)
def test_a_schedule_resumed_part_way_continues_the_rates_and_its_state_round_trips(schedule: WarmupDecay) -> None:
    settings = vars(schedule)
    optimizer = _sgd(0.5, 2.0)
    rates = _rates(optimizer, warmup_decay(optimizer, **settings), 7)
    saved = optimizer.state_dict()
    resumed = _sgd(0.5, 2.0)
    resumed.load_state_dict(saved)
    continued = warmup_decay(resumed, **settings, position=7)
    uninterrupted = _sgd(0.5, 2.0)
    whole = _rates(uninterrupted, warmup_decay(uninterrupted, **settings), 13)
    assert rates == whole[:7] and _rates(resumed, continued, 6) == whole[7:]
    fresh = warmup_decay(_sgd(0.5, 2.0), 0, 1)
    fresh.load_state_dict(continued.state_dict())
    assert fresh.lr_lambdas == [schedule] * 2 and fresh.last_epoch == 13
