"""Optimizers: first-order baselines (and, later, the K-FAC front)."""

from pipefisher.optim.first_order import build_optimizer

__all__ = ["build_optimizer"]
