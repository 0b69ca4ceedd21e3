"""Optimizers: first-order baselines (SGD, AdamW, LAMB) and learning-rate schedules."""

from pipefisher.optim.first_order import build_optimizer, build_scheduler, no_decay, parameter_groups

__all__ = ["build_optimizer", "build_scheduler", "no_decay", "parameter_groups"]
