"""Mixed precision: autocast for forward and backward, the dtype of stage-to-stage transfers, and
fp16's dynamic loss scale, kept on the device (no host read to scale, unscale or update it).

Master weights, gradients, optimizer state and K-FAC factors stay in float32 whatever the setting.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: torch.amp.GradScaler's defaults: x2 after this many steps without overflow, /2 on overflow
GROWTH_INTERVAL, GROWTH_FACTOR, BACKOFF_FACTOR = 2000, 2.0, 0.5


@dataclass(frozen=True)
class Precision:
    """`name` fp32, bf16 or fp16 on `device`: `compute_dtype` is what autocast computes in and what
    activations and their gradients are sent in. `step_cache` False: each forward casts the
    weights anew (ZeRO-2/3, whose FSDP2 parameters are gathered per op: a cast kept across
    micro-batches loses part of the gradient there, measured in tests/runtime/test_zero_sharded.py)."""

    name: str
    device: torch.device
    step_cache: bool = True

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def autocast(self) -> AbstractContextManager:
        """Context for a stage's forward (and its loss): autocast to the compute dtype, or nothing."""
        if self.name == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def step_casts(self) -> AbstractContextManager:
        """Context for a step, around its forwards' `autocast()`: autocast stays off in it, but the
        low-precision copies the forwards make of the weights are kept until it exits (autocast
        drops its cast cache only when the outermost region exits), so each weight is cast once
        per step on this thread, not once per micro-batch. Exit it before the weights change.
        Nothing without `step_cache`."""
        if self.name == "fp32" or not self.step_cache:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=False)


class LossScaler:
    """fp16's dynamic loss scale as a device tensor: the loss is multiplied by `scale` before its
    backward; gradients are divided by it and checked for inf/NaN; the ranks agree on the overflow
    flag (summed over all of them) before `update`, which halves the scale on overflow and doubles
    it after GROWTH_INTERVAL clean steps (torch.amp.GradScaler's rule and kernels)."""

    def __init__(self, initial: float, device: torch.device):
        self.scale = torch.full((1,), float(initial), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)

    def unscale_(self, gradients: list[Tensor]) -> Tensor:
        """Divide `gradients` by the scale in place; returns this rank's overflow flag (1, float32)."""
        found = torch.zeros(1, dtype=torch.float32, device=self.scale.device)
        if gradients:
            torch._amp_foreach_non_finite_check_and_unscale_(gradients, found, self.scale.double().reciprocal().float())
        return found

    def update(self, overflow: Tensor) -> None:
        """Next step's scale from the flag all ranks agreed on (> 0: some rank overflowed)."""
        torch._amp_update_scale_(
            self.scale,
            self.growth_tracker,
            (overflow > 0).float().reshape(1),
            GROWTH_FACTOR,
            BACKOFF_FACTOR,
            GROWTH_INTERVAL,
        )

    def state_dict(self) -> dict:
        return {"scale": self.scale.clone(), "growth_tracker": self.growth_tracker.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.scale.copy_(state["scale"])
        self.growth_tracker.copy_(state["growth_tracker"])
