"""LAMB (You et al., "Large Batch Optimization for Deep Learning", ICLR 2020).

No maintained package provides it without heavy or unusable dependencies here (timm's Lamb pulls
in torchvision; apex's FusedLAMB is CUDA-only), so it is implemented in this module.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from pipefisher.optim.update_step import UpdateStep

CPU_BATCH_ELEMENTS = 2**18
"""Elements one multi-tensor call steps on a device without multi-tensor kernels, where each call
loops over its tensors: on BERT 4x128's parameters (a CPU, one thread) runs of 2**16 to 2**18
elements took about 0.6 of the CPU time of one tensor at a time, or of all at once (whose
temporaries outgrow the cache)."""


class Lamb(UpdateStep):
    """Per parameter p with gradient g, at step t (counted from 1):

        m ← β₁m + (1−β₁)g,  v ← β₂v + (1−β₂)g²,  m̂ = m/(1−β₁ᵗ),  v̂ = v/(1−β₂ᵗ)
        u = m̂/(√v̂ + eps) + weight_decay·p,  r = ‖p‖/‖u‖ (r = 1 if either norm is 0)
        p ← p − lr·r·u

    As NVIDIA's NVLAMB, the trust ratio applies to every parameter (biases and LayerNorm too);
    unlike it, gradients are not pre-normalised by their global norm (the runtime clips them).
    Norms are over the whole tensor. Parameters without a gradient are skipped.
    """

    takes_closure = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        batch_elements: int | None = None,
    ):
        """`batch_elements`: the most elements one multi-tensor call steps (a larger tensor goes
        alone); None: unbounded on devices torch has multi-tensor kernels for (CUDA: a fixed number
        of kernels per step), CPU_BATCH_ELEMENTS elsewhere (a call's temporaries stay in cache)."""
        if not lr >= 0.0:
            raise ValueError(f"lr: expected >= 0, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {betas!r}")
        if not eps >= 0.0:
            raise ValueError(f"eps: expected >= 0, got {eps!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay: expected >= 0, got {weight_decay!r}")
        if batch_elements is not None and not (isinstance(batch_elements, int) and batch_elements >= 1):
            raise ValueError(f"batch_elements: expected a positive int or None, got {batch_elements!r}")
        self.batch_elements = batch_elements
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def update(self) -> None:
        """One LAMB update of every parameter that has a gradient (`step`, which evaluates a
        closure first). Steps are Python ints: nothing is read from a device."""
        for group in self.param_groups:
            for params in batches([p for p in group["params"] if p.grad is not None], self.batch_elements):
                self._update(group, params)

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """The docstring's update of `params` (same device and dtype, each with a gradient), tensor
        by tensor in the same operations and order as one parameter alone would take."""
        beta1, beta2 = group["betas"]
        grads = [_gradient(p) for p in params]
        if any(grad.is_sparse for grad in grads):
            raise RuntimeError("Lamb does not support sparse gradients")
        states = [self._state(p) for p in params]
        for state in states:
            state["step"] += 1
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        denominators = torch._foreach_div(exp_avg_sqs, [1.0 - beta2 ** s["step"] for s in states])
        torch._foreach_sqrt_(denominators)
        torch._foreach_add_(denominators, group["eps"])
        updates = torch._foreach_div(exp_avgs, [1.0 - beta1 ** s["step"] for s in states])
        torch._foreach_div_(updates, denominators)
        del denominators
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        weight_norms, update_norms = torch.stack(torch._foreach_norm([*params, *updates])).chunk(2)
        ratios = torch.where(torch.minimum(weight_norms, update_norms) > 0, weight_norms / update_norms, 1.0)
        torch._foreach_mul_(updates, (ratios * group["lr"]).unbind())
        torch._foreach_sub_(params, updates)

    def _state(self, p: Tensor) -> dict[str, Any]:
        """`p`'s state, created on its first step: step 0 (a Python int) and zero moments like `p`."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state


def batches(params: list[Tensor], batch_elements: int | None) -> list[list[Tensor]]:
    """`params` (each with a gradient) in the lists one multi-tensor call takes: runs, in the given
    order, of those sharing a device and dtype, of at most `batch_elements` elements together (as
    `Lamb`'s); one whose tensor or gradient is not contiguous alone (in a list it would move the
    whole call off torch's multi-tensor kernels, onto per-tensor ones that may round differently)."""
    together = _get_foreach_kernels_supported_devices()
    kinds: dict[tuple, list[Tensor]] = {}
    for p in params:
        alone = not (p.is_contiguous() and _gradient(p).is_contiguous())
        kinds.setdefault((p.device, p.dtype, id(p) if alone else None), []).append(p)
    runs: list[list[Tensor]] = []
    for kind in kinds.values():
        limit = batch_elements or (None if kind[0].device.type in together else CPU_BATCH_ELEMENTS)
        run: list[Tensor] = []
        size = 0
        for p in kind:
            if run and limit is not None and size + p.numel() > limit:
                runs.append(run)
                run, size = [], 0
            run.append(p)
            size += p.numel()
        runs.append(run)
    return runs


def _gradient(p: Tensor) -> Tensor:
    """`p`'s gradient (ValueError when it has none: the callers pick parameters with one)."""
    if p.grad is None:
        raise ValueError("Lamb steps parameters with a gradient only")
    return p.grad
