"""Count reads of tensor values into Python: each one waits for the device (a host sync on GPUs).

On this CPU-only machine a host read costs nothing, so tests count the calls that would stall a
GPU queue instead: `Tensor.item`, `tolist`, `cpu`, `numpy`, and conversion to float, int or bool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


@contextmanager
def count_host_reads() -> Iterator[Counter]:
    """Within the block, every host read of a tensor is counted by method name (the Counter)."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
