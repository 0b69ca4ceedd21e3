"""The planner's packing cache: pack results by what decides them, so a search packs each
distinct (schedule shape, layout profile, packer options) once (`PACKINGS`, this process's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipefisher.core.ir import Schedule
from pipefisher.core.profile import Profile
from pipefisher.methods.registry import method_of_profile
from pipefisher.planning.packing.options import PackOptions
from pipefisher.planning.packing.pack import PackResult
from pipefisher.planning.packing.step_end import pack_choosing_p_ops


@dataclass
class PackCache:
    """Pack results by what decides them: the schedule's shape (name, ranks, micro-batches,
    stages, pipes), the layout's profile (every stage's op and task times, after reductions and syncs)
    and the packer's options (method section, data-parallel copies, capture cap, pinned k). The
    packer is deterministic, so layouts that agree on these get the same result; `misses` counts
    the packings run, `hits` those answered from the cache; `enabled` False: every call packs."""

    results: dict[tuple, PackResult] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    enabled: bool = True

    def packed(
        self, schedule: Schedule, profile: Profile, options: PackOptions, without: Profile | None = None
    ) -> PackResult:
        """`pack_choosing_p_ops`'s result for `schedule`, `profile` (its method's rules), `options`
        and `without` (the profile of a run without the method's optional P ops). A capped
        packing's order is correct by construction (`PlanBuilder`): a ScheduleError from one is a
        bug, and it propagates."""
        shape = (schedule.name, schedule.num_ranks, schedule.num_micro_batches, schedule.num_stages, schedule.num_pipes)
        key = (shape, profile, options, without)
        if self.enabled and key in self.results:
            self.hits += 1
            return self.results[key]
        self.misses += 1
        result = pack_choosing_p_ops(schedule, profile, method_of_profile(profile).rules, options, without)
        if self.enabled:
            self.results[key] = result
        return result

    def clear(self) -> None:
        """Forget every result and count."""
        self.results.clear()
        self.hits = self.misses = 0


#: the packings of this process (`plan_layout`)
PACKINGS = PackCache()
