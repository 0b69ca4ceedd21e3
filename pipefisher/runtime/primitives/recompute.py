"""Activation recomputation (`model.recompute`): the modules a model's `recompute_plan(mode)` names
run under PyTorch's non-reentrant activation checkpoint, so a stage keeps only their inputs from
the forward and runs their forward again inside its backward, with the forward's RNG state (the
same dropout masks): the same gradients, bit for bit, for a second forward's time.

Hooks inside a recomputed module see its forward twice, once in the forward and once in the
backward. A hook that records per forward (K-FAC's capture) asks `recomputing()` and skips the
second, where `announce` is set. torch.compile cannot trace that announcement: compiled stages
are built with `announce=False`, and the methods that capture with hooks refuse `run.compile`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from pipefisher.core.tensor_parallel import module_matches


class _Recomputation:
    """The context of a recomputed forward (re-entrant: PyTorch may recompute a block more than
    once). A process-wide count, not a thread's: on a GPU the backward, and so the recomputation,
    runs on the autograd engine's device thread while the thread that called it waits."""

    depth = 0

    def __enter__(self) -> None:
        _Recomputation.depth += 1

    def __exit__(self, *exc: object) -> None:
        _Recomputation.depth -= 1


def recomputing() -> bool:
    """Whether the forward running now is a checkpointed module's recomputation (inside a backward)."""
    return _Recomputation.depth > 0


def _announce() -> tuple[Any, Any]:
    return nullcontext(), _Recomputation()


def _checkpointed(forward: Callable[..., Any], announce: bool) -> Callable[..., Any]:
    if announce:
        return lambda *args, **kwargs: checkpoint(
            forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_announce, **kwargs
        )
    return lambda *args, **kwargs: checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def recompute_modules(module: nn.Module, plan: Sequence[str], announce: bool = True) -> list[str]:
    """Checkpoint, in place, every module under `module` whose name matches a glob of `plan`
    (dot-part by dot-part); names and parameters stay as they were. Returns the names wrapped,
    in module order. `announce`: set `recomputing()` during recomputation (see the module docstring)."""
    wrapped = [
        (name, child)
        for name, child in module.named_modules()
        if name and any(module_matches(name, glob) for glob in plan)
    ]
    for _, child in wrapped:
        child.forward = _checkpointed(child.forward, announce)
    return [name for name, _ in wrapped]
