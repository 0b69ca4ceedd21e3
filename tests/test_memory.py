"""The per-rank memory and traffic model (`pipefisher.planning.memory.state`) against what real torch optimizers
and K-FAC engines hold for the tiny transformer, and against ZeRO's published example."""

import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from builders import tiny_model
from experiments.zero_memory import zero_paper_example
from pipefisher.methods.registry import methods
from pipefisher.config import config_from_dict
from pipefisher.methods.kfac import KfacConfig, KFACEngine
from pipefisher.methods.kfac.layer import preconditioned_parameters, select_layers
from pipefisher.methods.kfac.memory import KfacLayer
from pipefisher.planning.memory.state import (
    StageState,
    optimizer_state,
    rank_memory,
)
from pipefisher.core.topology import Topology
from pipefisher.models.tiny import TinyRegression
from pipefisher.runtime.training.optimizer import build_optimizer
from pipefisher.runtime.gradient_path.buffers import Ownership, unique_parameters
from pipefisher.runtime.training.checkpoint import tensor_bytes
from pipefisher.schedules import get_schedule

MODEL = tiny_model()
PIPELINES = {
    "1f1b-dp2": {"stages": 2, "micro_batches": 4, "schedule": "1f1b", "data_parallel": 2},
    "chimera-dp2": {"stages": 2, "micro_batches": 4, "schedule": "chimera", "data_parallel": 2},
    "interleaved-dp2": {"stages": 2, "micro_batches": 4, "schedule": "interleaved", "chunks": 2, "data_parallel": 2},
    "1f1b-dp3": {"stages": 2, "micro_batches": 4, "schedule": "1f1b", "data_parallel": 3},
}
OPTIMIZERS = {
    "adamw": {"name": "adamw"},
    "lamb": {"name": "lamb"},
    "sgd-momentum": {"name": "sgd", "momentum": 0.9},
    "sgd": {"name": "sgd"},
    "kfac-momentum": {"name": "kfac", "momentum": 0.9},  # AdamW for the parameters K-FAC leaves
    "kfac-momentum-rest-sgd": {"name": "kfac", "momentum": 0.9, "kfac": {"first_order": "sgd"}},
    "kfac-rest-lamb": {"name": "kfac", "kfac": {"first_order": "lamb"}},
}


def setup(pipeline: str, optimizer: dict | None = None, zero: int = 0):
    """The run of `optimizer` (its "kfac" entry: the kfac section) on `pipeline`."""
    optimizer = dict(optimizer or {})
    section = optimizer.pop("kfac", {})
    config = config_from_dict(
        {"model": MODEL, "pipeline": PIPELINES[pipeline], "optimizer": {**optimizer, "zero": zero}, "kfac": section}
    )
    p = config.pipeline
    schedule = get_schedule(p.schedule, p.stages, p.micro_batches, p.chunks if p.schedule == "interleaved" else None)
    return config, TinyRegression(config.model), Topology(schedule, p.data_parallel)


def stage_states(model: TinyRegression, num_stages: int) -> list[StageState]:
    """The model's inputs, read off freshly built stages the way the runtime sees them."""
    states = []
    for index in range(num_stages):
        module = model.build_stage(index, num_stages, seed=0)
        layers = select_layers(module, model.first_order_linears())
        parameters = unique_parameters(module)
        owned = {
            id(module.get_parameter(name)) for name in preconditioned_parameters(module, model.first_order_linears())
        }
        states.append(
            StageState(
                tuple(p.numel() for p in parameters),
                tuple(KfacLayer(name, st.info.a_size, st.info.b_size) for name, st in layers.items()),
                tuple(tuple(p.shape) for p in parameters),
                tuple(id(p) in owned for p in parameters),
            )
        )
    return states


def modelled(config, model, topology):
    settings = config.optimizer_settings
    rule = config.curvature.first_order if config.curvature is not None else "adamw"
    return rank_memory(
        topology,
        stage_states(model, topology.schedule.num_stages),
        optimizer_state(settings.name, settings.momentum, first_order=rule, memory=_memory_of(settings.name)),
        config.optimizer.zero,
    )


def test_the_model_imports_no_torch():
    code = "import sys, pipefisher.planning.memory.state\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("zero", [0, 1])
def test_optimizer_state_per_rank_is_what_torch_holds_after_a_step(pipeline, optimizer, zero):
    config, model, topology = setup(pipeline, OPTIMIZERS[optimizer], zero)
    expected = modelled(config, model, topology)
    num_stages = topology.schedule.num_stages
    for rank in range(topology.world_size):
        modules = {
            (pipe, stage): model.build_stage(stage, num_stages, seed=0) for pipe, stage in topology.stages_of(rank)
        }
        ownership = Ownership(topology, rank, modules, sharded=zero == 1)
        real = build_optimizer(config, modules.values(), ownership.updates, model.first_order_linears())
        for module in modules.values():
            for parameter in module.parameters():
                parameter.grad = torch.ones_like(parameter)
        real.step()
        assert expected[rank].optimizer_bytes == tensor_bytes(list(real.state.values())), f"rank {rank}"
        assert expected[rank].parameter_bytes == sum(
            4 * p.numel() for m in modules.values() for p in unique_parameters(m)
        )
        assert expected[rank].gradient_bytes == expected[rank].parameter_bytes


def refresh(engine: KFACEngine, module, stage: int, micro_batch: int, sender: KFACEngine | None = None) -> None:
    """One whole K-FAC refresh of `engine` in one process: capture a forward/backward, curvature,
    fold and invert (or, with `sender`, fold only and receive `sender`'s inverse, as a replica
    that did not invert), commit."""
    generator = torch.Generator().manual_seed(micro_batch)
    batch = {"inputs": torch.randn(2, MODEL["seq_len"], MODEL["input_dim"], generator=generator)}
    x = None if stage == 0 else torch.randn(2, MODEL["seq_len"], MODEL["hidden"], generator=generator)
    with engine.capture(micro_batch):
        module(x, batch).square().mean().backward()
    for info in engine.layers():
        for factor in "AB":
            engine.curvature(info.name, factor, micro_batch)
            engine.invert(info.name, factor, decompose=sender is None)
            if sender is not None:
                engine.receive_inverse(info.name, factor, sender.shared_inverse(info.name, factor).clone())
        engine.commit(info.name)


@pytest.mark.parametrize("pipeline", ["1f1b-dp2", "chimera-dp2", "interleaved-dp2"])
def test_kfac_state_per_rank_is_what_the_engines_hold_after_each_committed_refresh(pipeline):
    config, model, topology = setup(pipeline, OPTIMIZERS["kfac-momentum"])
    expected = modelled(config, model, topology)
    num_stages = topology.schedule.num_stages
    for rank in range(topology.world_size):
        modules = {
            (pipe, stage): model.build_stage(stage, num_stages, seed=0) for pipe, stage in topology.stages_of(rank)
        }
        engines = {
            key: KFACEngine(module, KfacConfig(), model.first_order_linears()) for key, module in modules.items()
        }
        assert all(engine.layers() for engine in engines.values())
        for cycle in range(2):  # the first refresh creates the state, the second replaces it
            for (pipe, stage), engine in engines.items():
                refresh(engine, modules[(pipe, stage)], stage, cycle)
            held = tensor_bytes({f"{pipe}.{stage}": engine.state_dict() for (pipe, stage), engine in engines.items()})
            assert expected[rank].curvature_bytes == held, f"rank {rank}, refresh {cycle}"


def test_a_replica_that_receives_its_inverses_holds_the_same_kfac_state():
    model = setup("1f1b-dp2")[1]
    for stage in range(2):
        source, module = model.build_stage(stage, 2, seed=0), model.build_stage(stage, 2, seed=0)
        inverting, receiving = KFACEngine(source), KFACEngine(module)
        refresh(inverting, source, stage, 0)
        refresh(receiving, module, stage, 0, sender=inverting)
        layers = [KfacLayer(info.name, info.a_size, info.b_size) for info in receiving.layers()]
        assert tensor_bytes(receiving.state_dict()) == sum(layer.state_bytes() for layer in layers)
        assert tensor_bytes(receiving.state_dict()) == tensor_bytes(inverting.state_dict())


def test_bias_is_folded_into_a_and_flags_and_counters_are_counted():
    assert KfacLayer("x", a_size=17, b_size=16).state_bytes() == 2 * 4 * (17 * 17 + 16 * 16) + 4 * 1 + 2 * 24
    engine = KFACEngine(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4, bias=False)))
    assert [(info.a_size, info.b_size) for info in engine.layers()] == [(17, 8), (8, 4)]


@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("zero", [0, 1])
def test_grad_traffic_is_twice_r_minus_one_over_r_of_the_fp32_gradients_held(pipeline, zero):
    config, model, topology = setup(pipeline, OPTIMIZERS["lamb"], zero)
    states = stage_states(model, topology.schedule.num_stages)
    for rank in modelled(config, model, topology):
        exact, floored, held = Fraction(0), 0, topology.stages_of(rank.rank)
        for _, stage in held:
            replicas, size = len(topology.replica_ranks(stage)), 4 * states[stage].numel
            exact += Fraction(2 * (replicas - 1), replicas) * size
            floored += 2 * ((replicas - 1) * size // replicas)  # ring_bytes counts whole bytes
        assert rank.grad_comm_bytes == floored, f"rank {rank.rank}"
        assert exact - 2 * len(held) < rank.grad_comm_bytes <= exact
        if all(4 * states[stage].numel % len(topology.replica_ranks(stage)) == 0 for _, stage in held):
            assert rank.grad_comm_bytes == exact
        assert rank.grad_comm_bytes > 0


def test_an_unreplicated_stage_sends_nothing():
    config = config_from_dict({"model": MODEL, "pipeline": {"stages": 2, "micro_batches": 4, "schedule": "1f1b"}})
    topology = Topology(get_schedule("1f1b", 2, 4), 1)
    for zero in (0, 1):
        ranks = rank_memory(topology, stage_states(TinyRegression(config.model), 2), optimizer_state("lamb"), zero)
        assert [rank.grad_comm_bytes for rank in ranks] == [0, 0]


@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("optimizer", ["adamw", "lamb", "sgd-momentum"])
def test_zero1_state_of_a_stage_sums_over_its_replicas_to_one_unsharded_copy(pipeline, optimizer):
    config, model, topology = setup(pipeline, OPTIMIZERS[optimizer], 0)
    whole = modelled(config, model, topology)
    sharded = modelled(*setup(pipeline, OPTIMIZERS[optimizer], 1))
    for stage in range(topology.schedule.num_stages):
        copies = {part.optimizer_bytes for rank in whole for part in rank.stages if part.stage == stage}
        assert len(copies) == 1
        shares = [part.optimizer_bytes for rank in sharded for part in rank.stages if part.stage == stage]
        assert len(shares) == len(topology.replica_ranks(stage))
        assert sum(shares) == copies.pop()
        assert max(shares) < sum(shares)  # it is actually shared


def test_zero_paper_example_is_reproduced():
    """Rajbhandari et al. (SC'20), Figure 1: Ψ = 7.5B, Nd = 64, K = 12: 120 GB baseline, 31.4 GB P_os."""
    baseline, p_os = zero_paper_example(zero=0), zero_paper_example(zero=1)
    assert baseline.total_bytes == 120 * 10**9
    assert round(p_os.total_bytes / 1e9, 1) == 31.4
    assert p_os.parameter_bytes + p_os.gradient_bytes == 4 * 7_500_000_000
    assert p_os.optimizer_bytes == 12 * 7_500_000_000 // 64


@pytest.mark.parametrize("workers", [1, 2])
def test_gradient_workers_keep_the_inverses_on_g_replicas_and_broadcast_within_blocks(workers):
    """Chimera with 2 copies: 4 replicas per stage. Summed over them, the K-FAC state is every
    replica's factors plus G copies of every inverse; each rank sends every layer's gradient
    once more, to a block of 4 / G."""
    config, model, topology = setup("chimera-dp2", OPTIMIZERS["kfac-momentum"])
    states = stage_states(model, 2)
    optimizer = optimizer_state("kfac", 0.9, memory=_memory_of("kfac"))
    every, kept = (
        rank_memory(topology, states, optimizer),
        rank_memory(topology, states, optimizer, workers_per_layer=workers),
    )
    for index, stage in enumerate(states):
        holders = topology.replica_ranks(index)
        factors = sum(layer.state_bytes(keeps_results=False) for layer in stage.curvature_layers)
        inverses = sum(layer.state_bytes() for layer in stage.curvature_layers) - factors

        def stage_part(ranks, rank):
            return next(part for part in ranks[rank].stages if part.stage == index)

        assert sum(stage_part(kept, rank).curvature_bytes for rank in holders) == 4 * factors + workers * inverses
        assert sum(stage_part(every, rank).curvature_bytes for rank in holders) == 4 * (factors + inverses)
        block = 4 // workers
        extra = sum(4 * layer.a_size * layer.b_size * (block - 1) // block for layer in stage.curvature_layers)
        assert all(
            stage_part(kept, rank).grad_comm_bytes - stage_part(every, rank).grad_comm_bytes == extra
            for rank in holders
        )


def test_powersgd_traffic_is_an_all_reduce_of_its_factors_and_of_what_it_leaves_whole():
    from pipefisher.planning.comm.volume import powersgd_elements, ring_bytes

    config, model, topology = setup("1f1b-dp2", OPTIMIZERS["sgd"])
    states = stage_states(model, 2)
    optimizer = optimizer_state("sgd")
    plain = rank_memory(topology, states, optimizer)
    for rank_r in (1, 4, 10_000):
        compressed = rank_memory(topology, states, optimizer, powersgd_rank=rank_r)
        for rank in range(topology.world_size):
            (part,) = compressed[rank].stages
            elements = sum(powersgd_elements(shape, rank_r) for shape in states[part.stage].shapes)
            assert part.grad_comm_bytes == ring_bytes("all_reduce", 4 * elements, 2)
            assert (part.grad_comm_bytes == plain[rank].grad_comm_bytes) == (rank_r == 10_000), (
                "a huge rank compresses nothing"
            )
    with pytest.raises(ValueError, match="shapes"):
        rank_memory(topology, [StageState(stage.parameters) for stage in states], optimizer, powersgd_rank=2)


def test_powersgd_state_is_what_the_runtime_keeps():
    from pipefisher.planning.memory.state import powersgd_state_bytes
    from pipefisher.runtime.gradient_path.buffers import GradientBuffer
    from pipefisher.runtime.gradient_path.powersgd import PowerSGD

    config, model, topology = setup("1f1b-dp2", OPTIMIZERS["sgd"])
    for index, stage in enumerate(stage_states(model, 2)):
        buffer = GradientBuffer(model.build_stage(index, 2, seed=0), bucket_bytes=1 << 30)
        for rank_r in (1, 3):
            assert powersgd_state_bytes(stage.shapes, rank_r) == tensor_bytes(
                PowerSGD(buffer, rank_r, seed=0).tensors()
            )


def test_a_curvature_method_without_a_memory_model_is_refused():
    with pytest.raises(ValueError, match="'shampoo': the method declares no memory model"):
        optimizer_state("shampoo", memory="")
    assert optimizer_state("kfac", 0.9, memory=_memory_of("kfac")).curvature and not optimizer_state("sgd").curvature


def _memory_of(name: str) -> str | None:
    """The memory model the method `name` declares ("" for none); None for a first-order optimizer."""
    known = methods().get(name)
    return None if known is None else known.memory
