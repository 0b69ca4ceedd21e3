"""Bytes of live tensors in a real run: what autograd saves for one stage's forward
(`saved_bytes`), and the peak of every live tensor's bytes over a stretch of a run
(`LiveTensorBytes`). The check of `pipefisher.planning.memory.activations` and
`pipefisher.planning.memory.peak` against the runtime."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext

import torch
from torch import Tensor, UntypedStorage, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _storage_key(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def saved_bytes(
    module: nn.Module,
    forward: Callable[[], object],
    precision: str = "fp32",
    held: Callable[[object], Iterable[Tensor]] = lambda out: (),
) -> int:
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


def _plain(tensors: Iterable[object]) -> Iterator[Tensor]:
    """The tensors among `tensors` that own memory: a wrapper subclass (a DTensor) stands for
    its inner tensors (a DTensor's local shard), whose storages hold its data; the wrapper's own
    storage is only its global size."""
    for tensor in tensors:
        if not isinstance(tensor, Tensor):
            continue
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            yield from _plain(getattr(tensor, name) for name in names)
        else:
            yield tensor


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of live tensors, each storage once, and their peak while the mode is on.

    `census()` starts from the floating-point tensors alive now (parameters, gradients, optimizer
    and curvature state, buffers; integer tensors are left out: a text run's token tables are the
    data source's, not training's). Inside the mode every storage an op allocates is added (an
    output sharing an input's storage is a view, not an allocation) and dropped once freed;
    after every op each known storage's size is read again (FSDP2 grows and frees its gathered
    parameters by resizing their storages in place, outside the dispatcher); `peak` is the
    largest sum seen after any op. A DTensor counts as its local shard (`_plain`)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def _add(self, tensor: Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        known = self._live.get(key)
        if known is not None and not known[0].expired():
            return
        if known is not None:
            self.current -= known[1]
        self._live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.current += storage.nbytes()

    def _sweep(self) -> None:
        """Drop the freed storages and read the others' sizes again."""
        for key, (ref, size) in list(self._live.items()):
            storage = UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:
                self.current -= self._live.pop(key)[1]
            elif storage.nbytes() != size:
                self.current += storage.nbytes() - size
                self._live[key] = (ref, storage.nbytes())

    def census(self) -> None:
        """Add the floating-point tensors alive now."""
        gc.collect()
        with warnings.catch_warnings():  # isinstance on torch's deprecated module aliases warns
            warnings.simplefilter("ignore", FutureWarning)
            found = [obj for obj in gc.get_objects() if isinstance(obj, Tensor)]
        for tensor in _plain(found):
            if tensor.is_floating_point() and tensor.device.type != "meta":
                self._add(tensor)
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in _plain(tree_leaves((args, kwargs)))}
        self._sweep()
        for tensor in _plain(tree_leaves(output)):
            if tensor.untyped_storage()._cdata not in inputs:
                self._add(tensor)
        self.peak = max(self.peak, self.current)
        return output
