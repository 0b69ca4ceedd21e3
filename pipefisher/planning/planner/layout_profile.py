"""The profile a layout's prediction simulates (`layout_profile`): the time source's, at the
layout's stage split, backward split, micro-batch size and degree, with what the layout adds to it.
Pure Python: no torch.

Data-parallel traffic: where the profile has
no measured `grad_reduce`, each stage's reduction is the bytes a rank sends for it
(`rank_memory`'s ring model: all-reduce, ZeRO-1's reduce + broadcast, ZeRO-2's reduce-scatter +
the step's one all-gather of its parameters, PowerSGD's factors) at `dp_bandwidth_gbps`; under
ZeRO-3 the reduction is the reduce-scatter, and FSDP2's all-gather of the stage's parameters
(ring model, same bandwidth) is added to every forward and backward of the stage (each op
gathers every block it runs, blocking: no overlap with compute is assumed). With stage replicas,
a curvature layer's factor syncs, where the layer is one of a Transformer block's Linears of
known shape, are the all-reduce of its n x n factors at that bandwidth. Recomputation: `pipefisher.planning.recompute` (backward += the recomputed share of the forward).

With a `hardware` description (`pipefisher.planning.planner.hardware`) every collective is costed
on the link it crosses (`pipefisher.planning.planner.links`, which also says how ranks are placed):
the data-parallel traffic above on the slowest link a stage's replicas span (its bandwidth
`dp_bandwidth_gbps` instead where `dp_bandwidth_set`), plus the link's latency per ring step
(all-reduce 2(n-1), reduce-scatter and all-gather n-1, n the replicas); pipeline hops without a
measured p2p time cost one micro-batch's activation (micro-batch x seq_len x hidden in the run's
precision) on the link between the two stages, plus one latency; that message is the stage's
`p2p_bytes`, so the profile's `link_speed` costs help ops' transfers (`<method>.helpers`). Without
it nothing changes.

Gradient workers (`PlanContext.workers_per_layer`: K-FAC's `grad_worker_fraction` below 1, Muon on
a replicated stage): the plan has no P ops (`pack_options`); after the reduction each worker
preconditions its layers, 1/n of the stage's in a block of n = R/G replicas, where a time source
that is not measured (flops, a reference CSV) puts that share into the stage's step end (a
measured profile timed it there: `KfacTimer`, `MuonTimer`), and then broadcasts them within its
block (``pgrad``), which no profile times: the stage's preconditioned gradient bytes broadcast
over n ranks (`rank_memory`'s `worker_bytes`, ring model) on the data-parallel link, plus its
latency per ring step, added to the step end as the method's work (`StageProfile.method_step_end`).
"""

from __future__ import annotations

from dataclasses import replace

from pipefisher.core.profile import LayerProfile, Profile, Samples, StageProfile
from pipefisher.planning.comm.volume import ring_bytes
from pipefisher.planning.packing.step_end import precondition_in_step_end
from pipefisher.planning.memory.activations import PRECISIONS
from pipefisher.planning.planner.candidates import Layout, stage_replicas
from pipefisher.planning.planner.context import PlanContext
from pipefisher.planning.planner.layer_models import block_linear_shapes
from pipefisher.planning.planner.layout_memory import stage_parameters, state_per_rank
from pipefisher.planning.planner.links import hop_links
from pipefisher.planning.planner.model_sizes import ModelSizes
from pipefisher.planning.planner.sources import MS_PER_UNIT
from pipefisher.planning.recompute import recompute_forward_share, with_recompute

FACTOR_BYTES = 4
#: bytes of an fp32 parameter element (what FSDP2 gathers)
PARAMETER_BYTES = 4


def _recomputed(profile: Profile, mode: str, sizes: ModelSizes, stage_blocks: tuple[int, ...] = ()) -> Profile:
    """The profile with recomputation's cost (`pipefisher.planning.recompute`): each stage's
    backward grows by the share of its forward that `mode` recomputes, by flops, its blocks
    (`stage_blocks`, else dealt out evenly) and the last stage's vocabulary projection counted
    outside them."""
    if mode == "none":
        return profile
    stages = profile.num_stages
    bounds = [round(stage * sizes.blocks / stages) for stage in range(stages + 1)]
    counts = stage_blocks or tuple(bounds[i + 1] - bounds[i] for i in range(stages))
    head = 2.0 * sizes.shape.head_rows * sizes.hidden * sizes.vocab
    shares = [
        recompute_forward_share(
            mode, sizes.hidden, sizes.ffn, sizes.seq_len, counts[i], head if i == stages - 1 else 0.0
        )
        for i in range(stages)
    ]
    return with_recompute(profile, mode, shares)


def _factor_sizes(sizes: ModelSizes, tensor_parallel: int) -> dict[str, tuple[int, int]]:
    """Layer-name suffix -> (A, B) factor sizes of a block's Linears (reference and BERT module names)."""
    return {suffix: (din + 1, dout) for suffix, (din, dout) in block_linear_shapes(sizes, tensor_parallel).items()}


def _with_reductions(profile: Profile, layout: Layout, context: PlanContext) -> Profile:
    """`profile` with each stage's modelled gradient reduction where it has no measured one, and
    under ZeRO-3 FSDP2's all-gathers in its forwards and backwards (`_gathering`)."""
    per_ms = MS_PER_UNIT[profile.time_unit]
    states = state_per_rank(
        layout, context.sizes, context.first_order, context.momentum, context.workers_per_layer(layout)
    )
    traffic = {part.stage: part.grad_comm_bytes - part.worker_bytes for rank in states for part in rank.stages}
    link = context.data_parallel_link(layout)
    scale = 1e3 / (link.bandwidth_gbps * 1e9) / per_ms
    ring_pass = link.latency_us * 1e-3 / per_ms * (stage_replicas(layout) - 1)  # latency of one pass round the ring
    reduce_passes = 2  # an all-reduce (or reduce + broadcast) is two passes
    gathers = [0.0] * profile.num_stages
    if layout.zero == 3 and layout.data_parallel > 1:
        parameters = stage_parameters(layout, context.sizes)
        gathers = [
            ring_bytes("broadcast", numel * PARAMETER_BYTES, layout.data_parallel) * scale + ring_pass
            for numel in parameters
        ]
        traffic = {
            index: ring_bytes("reduce", numel * PARAMETER_BYTES, layout.data_parallel)
            for index, numel in enumerate(parameters)
        }
        reduce_passes = 1
    return replace(
        profile,
        stages=tuple(
            _gathering(
                replace(
                    stage,
                    grad_reduce=stage.grad_reduce
                    or traffic.get(index, 0) * scale + (reduce_passes * ring_pass if traffic.get(index) else 0.0),
                ),
                gather,
            )
            for index, (stage, gather) in enumerate(zip(profile.stages, gathers))
        ),
    )


def _gathering(stage: StageProfile, gather: float) -> StageProfile:
    """`stage` with `gather` (profile time units) added to its forward and backward and to each of
    their samples."""
    if not gather:
        return stage
    samples = dict(stage.samples)
    for name in ("forward", "backward"):
        if name in samples:
            samples[name] = tuple(value + gather for value in samples[name])
    return replace(
        stage,
        forward=stage.forward + gather,
        backward=stage.backward + gather,
        weight=stage.weight_gradient,
        samples=Samples(samples),
    )


def _with_syncs(profile: Profile, layout: Layout, context: PlanContext) -> Profile:
    """`profile` with modelled factor syncs of the layers of known shape that have no measured ones."""
    replicas = stage_replicas(layout)
    if replicas < 2:
        return profile
    link = context.data_parallel_link(layout)
    scale = 1e3 / (link.bandwidth_gbps * 1e9) / MS_PER_UNIT[profile.time_unit]
    latency = 2 * (replicas - 1) * link.latency_us * 1e-3 / MS_PER_UNIT[profile.time_unit]
    factors = _factor_sizes(context.sizes, layout.tensor_parallel)

    def sync(layer: LayerProfile) -> LayerProfile:
        found = next((shape for suffix, shape in factors.items() if layer.name.endswith(suffix)), None)
        if found is None or layer.sync:
            return layer
        return replace(
            layer,
            sync=tuple(ring_bytes("all_reduce", n * n * FACTOR_BYTES, replicas) * scale + latency for n in found),
        )

    return replace(
        profile, stages=tuple(replace(stage, layers=tuple(map(sync, stage.layers))) for stage in profile.stages)
    )


def _with_hops(profile: Profile, layout: Layout, context: PlanContext) -> Profile:
    """`profile` with each stage's pipeline hop costed on its link (module docstring) where the
    context has hardware and the stage has no measured p2p time."""
    if context.hardware is None:
        return profile
    links = hop_links(layout, context.hardware)
    sizes = context.sizes
    activation = layout.micro_batch_size * sizes.seq_len * sizes.hidden * PRECISIONS[context.precision]
    per_ms = MS_PER_UNIT[profile.time_unit]

    def hop(index: int, stage: StageProfile) -> StageProfile:
        link = links[index] if index < len(links) else None
        if link is None or stage.p2p:
            return stage
        return replace(stage, p2p=link.ring_seconds(activation, 1) * 1e3 / per_ms, p2p_bytes=activation)

    return replace(profile, stages=tuple(hop(index, stage) for index, stage in enumerate(profile.stages)))


def _products_in_step_end(profile: Profile, layout: Layout, context: PlanContext) -> Profile:
    """A layout without the P op its method's profile times (Shampoo's helpers on a replicated
    or sharded stage, `PlanContext.precondition_op`) and without gradient workers: each stage's
    preconditioning joins the method's step end (before ZeRO-1 shares that among the owners)."""
    if context.precondition_op(layout) or context.workers_per_layer(layout) is not None:
        return profile
    return precondition_in_step_end(profile)


def _owned_step_end(profile: Profile, layout: Layout) -> Profile:
    """Under ZeRO-1 each of a stage's R replicas preconditions in its optimizer step only the
    matrices it owns (Shampoo's and SOAP's `precondition_all(updates)`, owners balanced by size):
    the method step end of an unmeasured source, one replica's whole stage, becomes 1/R of it."""
    replicas = stage_replicas(layout)
    if layout.zero != 1 or replicas < 2:
        return profile
    stages = tuple(
        replace(
            s,
            step_end=s.step_end - s.method_step_end * (1 - 1 / replicas),
            method_step_end=s.method_step_end / replicas,
        )
        for s in profile.stages
    )
    return replace(profile, stages=stages)


def _with_workers(profile: Profile, layout: Layout, context: PlanContext) -> Profile:
    """With gradient workers (module docstring), each stage's step end plus, from an unmeasured
    source, a worker's share of its preconditioning, and the broadcasts of its preconditioned
    gradients; both counted as the method's (`StageProfile.method_step_end`)."""
    workers = context.workers_per_layer(layout)
    if workers is None:
        return profile
    block = stage_replicas(layout) // workers
    states = state_per_rank(layout, context.sizes, context.first_order, context.momentum, workers)
    broadcast = {part.stage: part.worker_bytes for rank in states for part in rank.stages}
    per_ms = MS_PER_UNIT[profile.time_unit]
    link = context.data_parallel_link(layout)
    ring_pass = link.latency_us * 1e-3 / per_ms * (block - 1)

    def with_share(index: int, stage: StageProfile) -> StageProfile:
        share = 0.0 if context.source.measured_step_end else sum(layer.precondition for layer in stage.layers) / block
        sent = broadcast.get(index, 0)
        added = share + (sent * 1e3 / (link.bandwidth_gbps * 1e9) / per_ms + ring_pass if sent else 0.0)
        return replace(stage, step_end=stage.step_end + added, method_step_end=stage.method_step_end + added)

    return replace(profile, stages=tuple(with_share(index, stage) for index, stage in enumerate(profile.stages)))


def layout_profile(layout: Layout, context: PlanContext, syncs: bool = True) -> Profile:
    """The profile a layout's prediction simulates (module docstring): the source's at its stage
    split, backward split, micro-batch size and degree, the method's step end shared by ZeRO-1's
    owners (`_owned_step_end`) and by gradient workers, with their broadcasts (`_with_workers`),
    with recomputation, gradient reductions and (`syncs`) factor syncs."""
    split = layout.build_schedule().splits_backward
    profile = context.source.profile(
        layout.pieces, layout.micro_batch_size, layout.tensor_parallel, split, layout.stage_blocks
    )
    if not context.source.measured_step_end:
        profile = _owned_step_end(_products_in_step_end(profile, layout, context), layout)
    profile = _with_workers(profile, layout, context)
    profile = _with_reductions(
        _recomputed(profile, layout.recompute, context.sizes, layout.stage_blocks), layout, context
    )
    profile = _with_hops(profile, layout, context)
    return _with_syncs(profile, layout, context) if syncs else profile
