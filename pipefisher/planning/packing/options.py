"""What a packing may do: its margin, percentile, overhead budget, refresh bounds and strategy. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipefisher.planning.packing.greedy import STRATEGIES, Strategy


class RefreshSection(Protocol):
    """The placement keys of a curvature method's run-file section (`pipefisher.methods.settings.RefreshConfig`)."""

    @property
    def margin(self) -> float: ...
    @property
    def percentile(self) -> float: ...
    @property
    def max_overhead(self) -> float: ...
    @property
    def split(self) -> bool: ...
    @property
    def refresh_steps(self) -> int: ...
    @property
    def max_refresh_steps(self) -> int: ...
    @property
    def max_capture_mb(self) -> float: ...
    @property
    def helpers(self) -> bool: ...


@dataclass(frozen=True)
class PackOptions:
    """`margin`: share of each bubble kept free (0..1); `percentile`: pack with this percentile of
    the profile's measured samples (None: its nominal times); `max_overhead`: budget as a share of
    the first-order step time; `refresh_steps`: pin k; `max_refresh_steps`: cap k (None: no cap);
    `max_capture_mb`: cap on captured activations/gradients held per device (MiB; None: no cap);
    `data_parallel`: copies of the pipeline (factors are synced over them too); `precondition`
    False: no per-step precondition ops (K-FAC's gradient workers precondition in the step end); `strategy`
    ``published`` packs with the published rule alone, for comparison; `move_weights`: where the
    schedule splits the backward, let the fill strategy move weight gradients within their step
    (False: they stay where the schedule put them); `helpers`: hand layers of per-step work with
    no bubble to other ranks where that shortens the cycle (`pipefisher.planning.packing.helpers`;
    methods whose rules allow it, on one pipeline without data-parallel copies). The tasks packed are those of the task rules `pack` is given."""

    margin: float = 0.0
    percentile: float | None = 90.0
    max_overhead: float = 0.01
    split: bool = True
    strategy: Strategy = "fill"
    refresh_steps: int | None = None
    max_refresh_steps: int | None = None
    max_capture_mb: float | None = None
    data_parallel: int = 1
    precondition: bool = True
    move_weights: bool = True
    helpers: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin: {self.margin} must be in [0, 1)")
        if self.percentile is not None and not 0 < self.percentile <= 100:
            raise ValueError(f"percentile: {self.percentile} must be in (0, 100]")
        if self.max_overhead < 0:
            raise ValueError(f"max_overhead: {self.max_overhead} must be >= 0")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        for name in ("refresh_steps", "max_refresh_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: {value} must be at least 1")
        if self.max_capture_mb is not None and self.max_capture_mb <= 0:
            raise ValueError(f"max_capture_mb: {self.max_capture_mb} must be > 0")
        if self.data_parallel < 1:
            raise ValueError(f"data_parallel: {self.data_parallel} must be at least 1")

    @classmethod
    def from_section(
        cls,
        section: RefreshSection,
        *,
        data_parallel: int = 1,
        precondition: bool = True,
        refresh_steps: int | None = None,
        strategy: Strategy = "fill",
    ) -> PackOptions:
        """The options a curvature method's run-file section asks for (its 0s meaning "none" as None);
        `refresh_steps` replaces the section's."""
        return cls(
            margin=section.margin,
            percentile=section.percentile,
            max_overhead=section.max_overhead,
            split=section.split,
            strategy=strategy,
            refresh_steps=refresh_steps or section.refresh_steps or None,
            max_refresh_steps=section.max_refresh_steps or None,
            max_capture_mb=section.max_capture_mb or None,
            data_parallel=data_parallel,
            precondition=precondition,
            helpers=section.helpers,
        )
