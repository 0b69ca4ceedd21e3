"""A rank's micro-batches on the device: each built once per step from the run's data source (a
pure function of step and global micro-batch), and the next step's prepared ahead, while the
current step's reductions are in flight, so that building them is off the step's critical path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor

#: (step, global micro-batch) -> the micro-batch's named tensors
MicroBatchFn = Callable[[int, int], dict[str, Tensor]]


class DeviceBatch(Mapping[str, Tensor]):
    """One micro-batch: its host tensors, each copied to `device` when first read (pinned and
    non-blocking on CUDA) and kept. A stage moves only what it reads (a middle stage of BERT
    its attention mask), and the stages a rank holds share one copy."""

    def __init__(self, host: dict[str, Tensor], device: torch.device):
        self.host, self.device = host, device
        self.moved: dict[str, Tensor] = {}

    def __getitem__(self, name: str) -> Tensor:
        tensor = self.moved.get(name)
        if tensor is None:
            host = self.host[name]
            if self.device.type == "cuda":
                tensor = host.pin_memory().to(self.device, non_blocking=True)
            else:
                tensor = host.to(self.device)
            self.moved[name] = tensor
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.host)

    def __len__(self) -> int:
        return len(self.host)

    def move(self, names: Iterable[str]) -> None:
        """Copy `names` (those of them it has) to the device now."""
        for name in names:
            if name in self.host:
                self[name]


def prepare(
    source: MicroBatchFn, step: int, indices: Iterable[int], names: Iterable[str], device: torch.device
) -> dict[tuple[int, int], DeviceBatch]:
    """Global micro-batches `indices` of `step` built from `source`, `names` already on their way
    to `device`; keyed (step, global micro-batch) as the executor keys them."""
    names = sorted(set(names))
    batches = {}
    for index in indices:
        batch = batches[(step, index)] = DeviceBatch(source(step, index), device)
        batch.move(names)
    return batches
