"""Which link each of a layout's collectives crosses on a `Hardware`. Pure Python: no torch.

Rank placement, as `pipefisher.core.topology` orders processes: a rank is
replica x D + the schedule's placement of (pipe, stage), and a process (one GPU) is
rank x T + tensor-parallel shard, so tensor-parallel shards are innermost (neighbouring GPUs),
then pipeline ranks, then data-parallel replicas; GPU g sits on node g // gpus_per_node.

- tensor-parallel all-reduces: among the T shards of one rank, inside a node when T divides the
  GPUs per node (`Hardware.tensor_parallel_link`), else across nodes;
- data-parallel reductions (gradients, ZeRO-3's gathers, factor syncs): among the processes
  holding a stage (every replica, every pipe, one shard), on the slowest link any stage's group
  crosses (`data_parallel_link`);
- pipeline hops: stage s to s + 1 of every pipe and replica (`hop_links`), per stage.
Every collective pays its link's latency once per ring step (`Link.ring_seconds`).
"""

from __future__ import annotations

from functools import lru_cache

from pipefisher.core.topology import Topology
from pipefisher.planning.planner.candidates import Layout, schedule_of
from pipefisher.planning.planner.hardware import Hardware, Link


@lru_cache(maxsize=4096)
def _topology(schedule: str, stages: int, micro_batches: int, chunks: int, data_parallel: int, tp: int) -> Topology:
    return Topology(schedule_of(schedule, stages, micro_batches, chunks), data_parallel, tp)


def _topology_of(layout: Layout) -> Topology:
    return _topology(
        layout.schedule,
        layout.stages,
        layout.micro_batches,
        layout.chunks,
        layout.data_parallel,
        layout.tensor_parallel,
    )


def _gpus(topology: Topology, ranks: tuple[int, ...], shard: int) -> tuple[int, ...]:
    return tuple(topology.process(rank, shard) for rank in ranks)


@lru_cache(maxsize=4096)
def _data_parallel_link(layout: Layout, hardware: Hardware) -> Link:
    topology = _topology_of(layout)
    stages = sorted({stage for _, stage in topology.schedule.placement})
    groups = [
        _gpus(topology, topology.replica_ranks(stage), shard)
        for stage in stages
        for shard in range(layout.tensor_parallel)
    ]
    return hardware.inter if any(hardware.link_between(group) == hardware.inter for group in groups) else hardware.intra


def data_parallel_link(
    layout: Layout, hardware: Hardware | None, bandwidth_gbps: float, bandwidth_set: bool = False
) -> Link:
    """The link of the layout's data-parallel reductions: without `hardware` one of
    `bandwidth_gbps` and no latency (the planner's behaviour before hardware descriptions);
    with it the slowest any stage's replicas span (module docstring), at `bandwidth_gbps` instead
    of the link's own where `bandwidth_set` (`--dp-bandwidth-gbps` given)."""
    if hardware is None:
        return Link("data-parallel", bandwidth_gbps, 0.0)
    link = _data_parallel_link(layout, hardware)
    return Link(link.kind, bandwidth_gbps, link.latency_us) if bandwidth_set else link


@lru_cache(maxsize=4096)
def hop_links(layout: Layout, hardware: Hardware) -> tuple[Link | None, ...]:
    """Per stage s of the schedule (all but the last), the slowest link its activations cross to
    stage s + 1 over every pipe, replica and shard (None: the two stages share their GPUs, as
    DualPipeV's turn does)."""
    topology = _topology_of(layout)
    placement = topology.schedule.placement
    stages = max(stage for _, stage in placement) + 1
    links: list[Link | None] = []
    for stage in range(stages - 1):
        pairs = [
            (
                topology.process(topology.rank(replica, pipe, stage), shard),
                topology.process(topology.rank(replica, pipe, stage + 1), shard),
            )
            for replica in range(layout.data_parallel)
            for pipe, held in placement
            if held == stage and (pipe, stage + 1) in placement
            for shard in range(layout.tensor_parallel)
        ]
        pairs = [pair for pair in pairs if pair[0] != pair[1]]
        if not pairs:
            links.append(None)
            continue
        crosses = any(hardware.link_between(pair) == hardware.inter for pair in pairs)
        links.append(hardware.inter if crosses else hardware.intra)
    return tuple(links)
