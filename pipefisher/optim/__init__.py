"""Optimizers: first-order baselines (SGD, AdamW, LAMB), the composite of a curvature run (its
method's rule and a first-order rule for the rest) and learning-rate schedules."""

from pipefisher.optim.composite import Composite
from pipefisher.optim.first_order import build_optimizer, build_scheduler, no_decay, parameter_groups, rest_settings

__all__ = ["Composite", "build_optimizer", "build_scheduler", "no_decay", "parameter_groups", "rest_settings"]
