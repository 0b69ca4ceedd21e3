"""When to re-profile: the measured cycle time against the plan's prediction, cycle by cycle."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DriftMonitor:
    """Tracks the ratio measured / predicted cycle time (ms / ms) of a K-FAC plan.

    The expected ratio starts at 1. A re-profile is due when the ratio stays more than
    `threshold` (relative) away from the expected one for `patience` cycles in a row; the first
    `warmup_cycles` cycles of every plan are not judged. Right after a fresh measurement the
    profile describes the machine as it is, so the first judged ratio of a plan built on one
    becomes the expected ratio: a steady gap is the simulator's error (per-step costs no profile
    captures), not drift, and must not make the run re-profile again and again.
    """

    threshold: float
    patience: int
    warmup_cycles: int = 1
    expected: float = 1.0
    _cycles: int = 0
    _drifting: int = 0
    _calibrate: bool = False

    def new_plan(self, fresh_profile: bool) -> None:
        """A plan starts; `fresh_profile`: it comes from a profile measured just now."""
        self._cycles, self._drifting, self._calibrate = 0, 0, fresh_profile

    def observe(self, measured: float, predicted: float) -> bool:
        """Record one finished cycle; True when a re-profile is due."""
        self._cycles += 1
        if predicted <= 0 or self._cycles <= self.warmup_cycles:
            return False
        ratio = measured / predicted
        if self._calibrate:
            self.expected, self._calibrate = ratio, False
            return False
        self._drifting = self._drifting + 1 if abs(ratio / self.expected - 1) > self.threshold else 0
        return self._drifting >= self.patience

    @property
    def drifting_cycles(self) -> int:
        return self._drifting
