"""Warm-up / polynomial-decay schedule: multipliers at key steps, the LambdaLR, bad arguments."""

from __future__ import annotations

import warnings

import pytest
import torch

from pipefisher.optim.schedule import WarmupDecay, warmup_decay


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize(
    "settings, expected",
    [
        ((10, 110, 1.0, 0.0), {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.5, 100: 0.1, 110: 0.0, 500: 0.0}),
        ((10, 110, 2.0, 0.0), {10: 1.0, 60: 0.25, 100: 0.01, 110: 0.0}),
        ((10, 110, 1.0, 0.1), {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.55, 110: 0.1, 200: 0.1}),
        ((0, 4, 0.5, 0.0), {0: 1.0, 3: 0.5, 4: 0.0}),
        ((4, 4, 1.0, 0.2), {2: 0.5, 4: 0.2}),
        ((4, 10, 0.0, 1.0), {2: 0.5, 4: 1.0, 9: 1.0, 10: 1.0, 50: 1.0}),
    ],
)
def test_multipliers(settings: tuple, expected: dict[int, float]) -> None:
    schedule = WarmupDecay(*settings)
    for step, value in expected.items():
        assert schedule(step) == pytest.approx(value, abs=1e-12), step


def test_lambda_lr_follows_schedule_and_round_trips() -> None:
    make = lambda: torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in (0.5, 2.0)])
    optimizer = make()
    scheduler = warmup_decay(optimizer, warmup_steps=2, total_steps=6, power=1.0, final_fraction=0.0)
    seen = []
    for _ in range(7):
        seen.extend(group["lr"] for group in optimizer.param_groups)
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.0, 0.0, 0.25, 1.0, 0.5, 2.0, 0.375, 1.5, 0.25, 1.0, 0.125, 0.5, 0.0, 0.0])
    state = scheduler.state_dict()
    fresh = warmup_decay(make(), warmup_steps=100, total_steps=1000)
    fresh.load_state_dict(state)
    assert fresh.lr_lambdas == [WarmupDecay(2, 6)] * 2 and fresh.last_epoch == 7


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"total_steps": 0, "warmup_steps": 0}, "total_steps"),
        ({"total_steps": 5, "warmup_steps": 10}, "total_steps"),
        ({"total_steps": True}, "total_steps"),
        ({"power": -1.0}, "power"),
        ({"power": "1"}, "power"),
        ({"final_fraction": 1.5}, "final_fraction"),
        ({"final_fraction": -0.1}, "final_fraction"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict, name: str) -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=name):
        warmup_decay(optimizer, **{"warmup_steps": 10, "total_steps": 100, **kwargs})


def test_a_scheduler_built_at_a_resumed_position_continues_the_rates_without_a_warning() -> None:
    """A resumed run loads the optimizer state, then builds its scheduler where the checkpoint
    left off: the same rates as the uninterrupted run, and no torch warning about stepping a
    scheduler before its optimizer."""
    make = lambda: torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in (0.5, 2.0)])
    optimizer = make()
    scheduler = warmup_decay(optimizer, warmup_steps=2, total_steps=6)
    rates = []
    for step in range(6):
        if step == 3:
            saved = optimizer.state_dict()
        rates.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    resumed = make()
    resumed.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        continued = warmup_decay(resumed, warmup_steps=2, total_steps=6, position=3)
        again = []
        for _ in range(3, 6):
            again.append([group["lr"] for group in resumed.param_groups])
            resumed.step()
            continued.step()
    assert again == rates[3:] and continued.last_epoch == 6
