"""Bytes of live tensors in a real run: what autograd saves for one stage's forward
(`saved_bytes`), and the peak of every live tensor's bytes over a stretch of a run
(`LiveTensorBytes`). The check of `pipefisher.planning.activation_memory` and
`pipefisher.planning.peak_memory` against the runtime."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch
from torch import Tensor, nn


def _storage_key(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def saved_bytes(module: nn.Module, forward: Callable[[], object], precision: str = "fp32",
                held: Callable[[object], Iterable[Tensor]] = lambda out: ()) -> int:
    """Bytes of the storages autograd saves while `forward()` runs (under bf16/fp16 autocast
    when `precision` says so), each storage once, `module`'s parameters excluded; plus the
    storages of the tensors `held(output)` names (what the stage runtime keeps beside them)."""
    parameters = {_storage_key(p) for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        key = _storage_key(tensor)
        if key not in parameters:
            seen.setdefault(key, tensor.untyped_storage().nbytes())
        return tensor

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    device = next(module.parameters()).device.type
    cast = torch.autocast(device, dtype=dtype) if dtype is not None else nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), cast:
        output = forward()
    for tensor in held(output):
        if tensor is not None and _storage_key(tensor) not in parameters:
            seen.setdefault(_storage_key(tensor), tensor.untyped_storage().nbytes())
    return sum(seen.values())
