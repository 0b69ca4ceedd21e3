"""Where everything lives: ranks of (data-parallel replica, pipe, stage), and processes of
(rank, tensor-parallel shard).

Replica r of the pipeline occupies ranks r·D .. r·D + D − 1, laid out as the schedule's
placement says. Global micro-batch ids run replica by replica: replica r owns r·N .. r·N + N − 1.

With tensor parallelism T, each rank is T processes, one per shard of its blocks, which run the
same actions on the same micro-batches: process p is shard p mod T of rank p // T, so the
processes of a rank are neighbours (they share a node under torchrun and the launcher). This is
the device mesh (data, pipeline, tensor) in row-major order. "Rank" below always means the
pipeline × data-parallel position; with T = 1 a rank is its process.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipefisher.core.ir import Schedule


@dataclass(frozen=True)
class Topology:
    schedule: Schedule
    data_parallel: int = 1
    tensor_parallel: int = 1

    @property
    def pipeline_ranks(self) -> int:
        return self.schedule.num_ranks

    @property
    def world_size(self) -> int:
        """Ranks: pipeline positions x data-parallel replicas (each rank is `tensor_parallel` processes)."""
        return self.pipeline_ranks * self.data_parallel

    @property
    def processes(self) -> int:
        return self.world_size * self.tensor_parallel

    def process(self, rank: int, shard: int) -> int:
        """The process holding tensor-parallel shard `shard` of `rank`."""
        return rank * self.tensor_parallel + shard

    def rank_of_process(self, process: int) -> tuple[int, int]:
        """(rank, shard) of a process."""
        return divmod(process, self.tensor_parallel)

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
        return tuple(
            sorted(
                self.rank(replica, pipe, s)
                for replica in range(self.data_parallel)
                for (pipe, s) in self.schedule.placement
                if s == stage
            )
        )

    def global_micro_batch(self, rank: int, micro_batch: int) -> int:
        return self.replica_of(rank) * self.schedule.num_micro_batches + micro_batch

    @property
    def total_micro_batches(self) -> int:
        return self.schedule.num_micro_batches * self.data_parallel
