"""The run's optimizer and learning-rate schedule from its configuration: a first-order run's rule, or
a curvature run's `Composite` of its method's rule and a first-order rule for the rest."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from torch import nn

from pipefisher.config import RunConfig
from pipefisher.methods.registry import methods
from pipefisher.optim.composite import Composite
from pipefisher.optim.first_order import first_order, named, parameter_groups
from pipefisher.optim.schedule import WarmupDecay, warmup_decay


def build_optimizer(
    config: RunConfig,
    modules: Iterable[nn.Module],
    keep: Callable[[nn.Parameter], bool] = lambda parameter: True,
    skip: tuple[str, ...] | None = None,
) -> torch.optim.Optimizer:
    """The run's optimizer over the parameters of `modules` that `keep` accepts (ZeRO-1: the
    rank's own). A first-order run: its `optimizer.name` rule. A curvature run: a `Composite` of
    the method's rule over the parameters it preconditions (`MethodParts.preconditioned`, with its
    `skip` globs, `MethodParts.skip` of the model: required) and the section's `first_order` rule
    over the rest (`RunConfig.rest_settings`)."""
    modules = list(modules)
    settings = config.optimizer
    if config.curvature is None:
        return first_order(settings, parameter_groups(modules, settings.weight_decay, keep))
    if skip is None:
        raise ValueError(f"build_optimizer: a {settings.name} run needs its skip globs (MethodParts.skip of the model)")
    parts = methods()[settings.name].runtime_parts()
    owned = {
        id(parameter) for module in modules for parameter in named(module, parts.preconditioned(config, module, skip))
    }
    method_groups = parameter_groups(modules, settings.weight_decay, lambda p: keep(p) and id(p) in owned)
    rest_groups = parameter_groups(modules, settings.weight_decay, lambda p: keep(p) and id(p) not in owned)
    method_rule = parts.optimizer or (
        lambda run, groups: first_order(replace(run.optimizer_settings, name="sgd"), groups)
    )
    return Composite(
        {"method": method_rule(config, method_groups), "rest": first_order(config.rest_settings, rest_groups)}
    )


def build_scheduler(
    config: RunConfig, optimizer: torch.optim.Optimizer, position: int = 0
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """Warm-up then the `optimizer.decay` schedule (`schedule_of`) over every parameter group (a
    curvature run's method rate and the rest's alike), starting after `position` optimizer steps (a
    resumed run, whose optimizer state is loaded); None when the rate is constant."""
    schedule = schedule_of(config)
    if schedule is None:
        return None
    return warmup_decay(optimizer, **vars(schedule), position=position)


def schedule_of(config: RunConfig) -> WarmupDecay | None:
    """The run's `WarmupDecay` over decay_steps or else run.steps (so a resumed run must keep its
    step count); None when the rate is constant."""
    settings = config.optimizer
    if settings.warmup_steps == 0 and settings.decay == "constant":
        return None
    total = settings.decay_steps or config.run.steps
    warmup = min(settings.warmup_steps, total)  # a short run (e.g. a smoke test) stays in warm-up
    shape = settings.wsd_shape if settings.decay == "wsd" else settings.decay
    return WarmupDecay(
        warmup,
        total,
        power=settings.decay_power,
        final_fraction=settings.min_lr_fraction,
        shape={"linear": "polynomial"}.get(shape, shape),
        decay_fraction=settings.decay_fraction if settings.decay == "wsd" else 1.0,
    )
