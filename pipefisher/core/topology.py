"""Where everything lives: global ranks of (data-parallel replica, pipe, stage).

Replica r of the pipeline occupies ranks r·D .. r·D + D − 1, laid out as the schedule's
placement says. Global micro-batch ids run replica by replica: replica r owns r·N .. r·N + N − 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipefisher.core.ir import Schedule


@dataclass(frozen=True)
class Topology:
    schedule: Schedule
    data_parallel: int = 1

    @property
    def pipeline_ranks(self) -> int:
        return self.schedule.num_ranks

    @property
    def world_size(self) -> int:
        return self.pipeline_ranks * self.data_parallel

    def rank(self, replica: int, pipe: int, stage: int) -> int:
        return replica * self.pipeline_ranks + self.schedule.placement[(pipe, stage)]

    def replica_of(self, rank: int) -> int:
        return rank // self.pipeline_ranks

    def pipeline_rank(self, rank: int) -> int:
        return rank % self.pipeline_ranks

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """(pipe, stage) pairs whose parameters `rank` holds, by stage then pipe."""
        return sorted(self.schedule.stages_of(self.pipeline_rank(rank)), key=lambda key: (key[1], key[0]))

    def replica_ranks(self, stage: int) -> tuple[int, ...]:
        """All ranks holding a copy of `stage` (other pipes, other data-parallel replicas)."""
        return tuple(sorted(
            self.rank(replica, pipe, s)
            for replica in range(self.data_parallel)
            for (pipe, s) in self.schedule.placement
            if s == stage
        ))

    def global_micro_batch(self, rank: int, micro_batch: int) -> int:
        return self.replica_of(rank) * self.schedule.num_micro_batches + micro_batch

    @property
    def total_micro_batches(self) -> int:
        return self.schedule.num_micro_batches * self.data_parallel
