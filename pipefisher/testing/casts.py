"""Counting the copies autocast makes of a model's parameters (issue 43: each weight cast once per
step), for tests and benchmarks."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class WeightCasts(TorchDispatchMode):
    """Counts, per parameter (by id), the copies (`aten._to_copy`) made of it while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[int] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter):
            self.counts[id(args[0])] += 1
        return func(*args, **(kwargs or {}))
