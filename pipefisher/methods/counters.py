"""Numerics counters kept on the device (the methods' health) and read in one go."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import fields
from typing import TypeVar

import torch
from torch import Tensor

#: what the counters are keyed by (a matrix name, a (layer, factor) pair)
Key = TypeVar("Key", bound=Hashable)


def zero_counters(health: type, device: torch.device) -> Tensor:
    """A fresh int64 vector on ``device`` with one counter per field of the dataclass ``health``."""
    return torch.zeros(len(fields(health)), dtype=torch.int64, device=device)


def read_counters(counters: Mapping[Key, Tensor]) -> dict[Key, tuple[int, ...]]:
    """Host values of all ``counters`` (integer vectors) with ONE host read: they are stacked on
    the first one's device first."""
    if not counters:
        return {}
    device = next(iter(counters.values())).device
    values = torch.stack([c.to(device) for c in counters.values()]).tolist()
    return {key: tuple(v) for key, v in zip(counters, values)}
