"""The optimizer of a curvature run (`build_optimizer`): the parameters its method preconditions
step with the method's SGD, every other one with the section's `first_order` rule, each exactly
as an independent torch optimizer over just those parameters; `first_order: sgd` steps as one SGD
over every parameter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from builders import tiny_model
from pipefisher.config import config_from_dict
from pipefisher.models.tiny import TinyRegression
from pipefisher.optim.first_order import no_decay, parameter_groups
from pipefisher.runtime.training.optimizer import build_optimizer, build_scheduler
from pipefisher.runtime.training.assembly import data_source
from pipefisher.runtime.training.trainer import method_skip

STEPS = 3


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def run(method: str, **section):
    """A two-stage tiny transformer under `method`: its lr 0.02 with momentum 0.9, optimizer.lr
    0.005 with weight decay 0.1 (AdamW's betas and eps from the optimizer section)."""
    return config_from_dict(
        {
            "model": tiny_model(),
            "optimizer": {"name": method, "lr": 0.005, "weight_decay": 0.1, "betas": [0.8, 0.99], "eps": 1e-6},
            method: {"lr": 0.02, "momentum": 0.9, **section},
        }
    )


def stages(config) -> tuple[list[nn.Module], TinyRegression]:
    model = TinyRegression(config.model)
    return [model.build_stage(index, 2, seed=0) for index in range(2)], model


def backward(modules: list[nn.Module], model: TinyRegression, config, step: int) -> None:
    """Real gradients: the model's loss on micro-batch (step, 0)."""
    batch = data_source(config)(step, 0)
    x = None
    for module in modules:
        x = module(x, batch)
    model.loss(x, batch)[0].backward()


def decay_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    return [
        {"params": [p for n, p in named if not no_decay(n)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ]


#: what each method preconditions in the tiny transformer, stated independently of its code
PRECONDITIONED = {
    "kfac": lambda module, name, p: isinstance(module.get_submodule(name.rsplit(".", 1)[0]), nn.Linear),
    "shampoo": lambda module, name, p: p.dim() >= 2,
}


@pytest.mark.parametrize("method", ["kfac", "shampoo"])
def test_the_rest_steps_as_adamw_and_the_preconditioned_parameters_as_the_methods_sgd(method):
    config = run(method)
    modules, model = stages(config)
    twins = [copy.deepcopy(module) for module in modules]
    optimizer = build_optimizer(config, modules, skip=method_skip(config, model))
    owned, rest = [], []
    for module in twins:
        for name, p in module.named_parameters():
            (owned if PRECONDITIONED[method](module, name, p) else rest).append((name, p))
    assert owned and rest
    adamw = torch.optim.AdamW(decay_groups(rest, 0.1), lr=0.005, betas=(0.8, 0.99), eps=1e-6, fused=True)
    sgd = torch.optim.SGD(decay_groups(owned, 0.1), lr=0.02, momentum=0.9, foreach=False)
    for step in range(STEPS):
        backward(modules, model, config, step)
        backward(twins, model, config, step)
        optimizer.step()
        adamw.step()
        sgd.step()
        for module in modules + twins:
            module.zero_grad(set_to_none=True)
    for module, twin in zip(modules, twins):
        for (name, p), (_, expected) in zip(module.named_parameters(), twin.named_parameters()):
            assert torch.equal(p, expected), name
    assert len(optimizer.state) == len(owned) + len(rest)


@pytest.mark.parametrize("method", ["kfac", "shampoo"])
def test_first_order_sgd_steps_as_one_sgd_over_every_parameter(method):
    """`first_order: sgd` at the section's lr and momentum is one SGD over every parameter."""
    config = run(method, first_order="sgd")
    modules, model = stages(config)
    twins = [copy.deepcopy(module) for module in modules]
    one = torch.optim.SGD(parameter_groups(twins, 0.1), lr=0.02, momentum=0.9, foreach=False)
    optimizer = build_optimizer(config, modules, skip=method_skip(config, model))
    for step in range(2 * STEPS):
        for net, stepper in ((modules, optimizer), (twins, one)):
            backward(net, model, config, step)
            stepper.step()
            stepper.zero_grad(set_to_none=True)
    for module, twin in zip(modules, twins):
        assert all(torch.equal(p, q) for p, q in zip(module.parameters(), twin.parameters()))


def test_a_curvature_run_needs_the_skip_globs():
    config = run("kfac")
    with pytest.raises(ValueError, match="skip globs"):
        build_optimizer(config, stages(config)[0])


def test_the_schedule_scales_both_rules_from_their_own_rates_also_after_a_state_is_loaded():
    """Loading a state dict gives the parts new group dicts (the profiler restores its state
    before training starts): the scheduler must go on scaling those."""
    config = run("kfac").with_overrides(optimizer={"warmup_steps": 4}, run={"steps": 10})
    modules, model = stages(config)
    optimizer = build_optimizer(config, modules, skip=method_skip(config, model))
    scheduler = build_scheduler(config, optimizer)

    def rates() -> dict[str, list[float]]:
        return {name: [group["lr"] for group in part.param_groups] for name, part in optimizer.parts.items()}

    for _ in range(2):
        optimizer.step()
        scheduler.step()
    assert rates() == {"method": pytest.approx([0.01, 0.01]), "rest": pytest.approx([0.0025, 0.0025])}, (
        "half-way through warm-up"
    )
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01), "the reported rate is the method's"
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    assert rates() == {"method": pytest.approx([0.02, 0.02]), "rest": pytest.approx([0.005, 0.005])}, "warmed up"
