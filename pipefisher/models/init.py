"""Split-independent initialisation: a module's parameters depend on (seed, its global name) alone."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
from torch import nn

#: sets the parameters a module holds itself (not its children's) from the generator; raises on
#: a module type it does not know
Init = Callable[[nn.Module, torch.Generator], None]
M = TypeVar("M", bound=nn.Module)


def derive_seed(seed: int, tag: str) -> int:
    """A 63-bit seed determined by (seed, tag) alone, the same in every process."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{tag}".encode()).digest()[:8], "little") >> 1


def build_initialised(make: Callable[[], M], seed: int, init: Init, drawn_as: Mapping[str, str] | None = None) -> M:
    """`make()`, then `init(module, generator)` for each submodule holding parameters of its own, the
    generator seeded from (seed, the module's name), or (seed, drawn_as[name]) for a module drawn
    like another (a tied copy). With global module names no parameter depends on the split.
    Leaves torch's global RNG state as it was."""
    drawn_as = drawn_as or {}
    with torch.random.fork_rng(devices=[]):
        root = make()
    with torch.no_grad():
        for name, module in root.named_modules():
            if next(module.parameters(recurse=False), None) is not None:
                init(module, torch.Generator().manual_seed(derive_seed(seed, drawn_as.get(name, name))))
    return root
