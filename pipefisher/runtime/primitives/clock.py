"""Timestamps of device work: `perf_counter` on CPUs, CUDA events on GPUs (recorded on the current
stream, so a mark is when the device gets there, not when the host issued it; no host sync until
`elapsed_ms`); and `timed_ms` for standalone regions (profiling only: it synchronises)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


#: a clock's mark: seconds (`perf_counter`) on CPUs, a recorded CUDA event on GPUs
Mark = float | torch.cuda.Event


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: Mark, end: Mark) -> float:
        """Milliseconds from mark `start` to mark `end` (waits for the device on GPUs)."""
        if isinstance(start, float) and isinstance(end, float):
            return 1000.0 * (end - start)
        if isinstance(start, float) or isinstance(end, float):
            raise TypeError("marks of one clock: both times or both CUDA events")
        end.synchronize()
        return start.elapsed_time(end)


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> list[float]:
    """Wall times of `repeats` calls of `fn()` in ms, the device synchronised before and after each."""
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(1000 * (time.perf_counter() - start))
    return samples
