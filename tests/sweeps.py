"""What the sweeps iterate: the registries of schedules (`pipefisher.schedules.SCHEDULES`) and of
curvature methods (`pipefisher.methods.registry.methods()`), so that a schedule or a
method added to a registry is swept by every sweep without editing a test.

Sizes come from the schedule itself, never from its name: a size is valid when the schedule's
generator builds it (`get_schedule` raises ScheduleError for the others: Chimera's even D and N a
multiple of D, interleaved's N a multiple of D, DualPipeV's N >= 2D, ...). A sweep whose sizes
leave a registered schedule without a case fails at collection, naming it, rather than sweep
nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from pipefisher.schedules import SCHEDULES, get_schedule
from pipefisher.testing.harness import builds, micro_batches_for, pipeline  # noqa: F401  (the public harness's sizes)


def cases(*sizes: tuple[int, Iterable[int]], first: bool = False, names: Iterable[str] = SCHEDULES) -> list:
    """`pytest.param(name, D, N)` for every schedule of `names` (default: the registry) and every
    (D, Ns) of `sizes`: each N of Ns the schedule builds on D stages (with `first`: only the first
    such N); ids `name-DxN`."""
    params, covered = [], set()
    for name in names:
        for d, micro_batches in sizes:
            for n in micro_batches:
                if builds(name, d, n):
                    params.append(pytest.param(name, d, n, id=f"{name}-{d}x{n}"))
                    covered.add(name)
                    if first:
                        break
    missing = [name for name in names if name not in covered]
    assert not missing, f"no size of this sweep builds schedule(s) {missing}: give the sweep sizes they accept"
    return params


def splits_backward(name: str) -> bool:
    """Whether schedule `name` splits the backward into input and weight gradients (B and W)."""
    return get_schedule(name, 2, micro_batches_for(name, 2)).splits_backward


def dealt(part: int, parts: int, names: Sequence[str] | None = None) -> list[str]:
    """The registry's schedules dealt round-robin over `parts` tests, this test's share
    (`part` of 0..parts-1): expensive combinations run a share each, the tests together every
    schedule once."""
    names = list(SCHEDULES if names is None else names)
    assert 0 <= part < parts <= len(names)
    return names[part::parts]


def paired(methods: Sequence[str], per_method: int = 2, names: Sequence[str] | None = None) -> list:
    """`pytest.param(method, schedule)` pairs for sweeps too expensive for every combination: the
    i-th pair takes method i mod M and schedule i mod S of the registry, max(per_method·M, S)
    pairs, so every method meets `per_method` schedules (or more) and every schedule a method."""
    names = list(SCHEDULES if names is None else names)
    count = max(per_method * len(methods), len(names))
    pairs = [(methods[i % len(methods)], names[i % len(names)]) for i in range(count)]
    return [pytest.param(method, name, id=f"{method}-{name}") for method, name in pairs]
