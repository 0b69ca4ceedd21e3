"""Muon's engine beyond the oracle: which weights it takes, the shape scale of a Conv1D weight
(stored transposed), same-shape matrices stacked into one Newton–Schulz, a skipped step, the state a checkpoint keeps, and the memory model against
the tensors each replica holds."""

import pytest
import torch
from torch import nn

from builders import tiny_model
from pipefisher import testing
from pipefisher.methods.registry import methods
from pipefisher.config import config_from_dict
from pipefisher.core.topology import Topology
from pipefisher.methods.muon.engine import MuonEngine, shape_groups
from pipefisher.methods.muon.memory import MuonLayer
from pipefisher.methods.muon.method import MuonConfig
from pipefisher.methods.muon.runtime import MuonRuntime, first_order_globs
from pipefisher.models.tiny import TinyRegression
from pipefisher.planning.memory.state import StageState, optimizer_state, rank_memory
from pipefisher.runtime.gradient_path.buffers import unique_parameters
from pipefisher.schedules import get_schedule


def test_it_takes_the_linear_weights_but_skipped_ones_and_leaves_the_rest():
    net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    assert MuonEngine(net, MuonConfig()).names() == ["1.weight", "3.weight"]
    assert MuonEngine(net, MuonConfig(), skip=("*3.weight",)).names() == ["1.weight"]


def test_a_conv1d_weight_takes_the_scale_of_the_layer_it_maps():
    """GPT-2's Conv1D stores an (in, out) weight: its step is the transposed twin Linear's."""
    from transformers.pytorch_utils import Conv1D

    linear, conv = nn.Linear(4, 12, bias=False), Conv1D(12, 4)
    with torch.no_grad():
        conv.weight.copy_(linear.weight.T)
    gradient = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    linear.weight.grad, conv.weight.grad = gradient.clone(), gradient.T.clone()
    settings = MuonConfig()
    for module in (linear, conv):
        engine = MuonEngine(module, settings)
        engine.orthogonalise(["weight"])
        engine.apply()
    assert MuonEngine(conv, settings).matrices["weight"].rows == 12
    torch.testing.assert_close(conv.weight.grad, linear.weight.grad.T, rtol=1e-6, atol=1e-7)
    # five quintic iterations leave singular values in about [0.7, 1.2]: times √3 (12 rows, 4 columns)
    assert 1.1 < torch.linalg.svdvals(linear.weight.grad).mean() < 2.1, "√3 times an orthogonalised matrix"


def test_same_shape_matrices_are_orthogonalised_as_one_stack_and_equal_one_at_a_time():
    """Two blocks' square, wide and tall weights: the wide (8, 32) and tall (32, 8) ones form one
    group with the square ones apart, by dtype too; the stacked step (fp16's loss scale and
    Nesterov momentum included) equals the matrix-by-matrix one, over three steps, up to float32
    rounding (a stacked tall matrix is a contiguous copy, not a transposed view: other sums)."""

    def block() -> list[nn.Module]:
        return [nn.Linear(8, 8), nn.Linear(8, 32), nn.Linear(32, 8)]

    torch.manual_seed(0)
    net = nn.Sequential(*block(), *block(), nn.Linear(8, 8).double())
    assert shape_groups([p for p in net.parameters() if p.dim() == 2]) == [[0, 3], [1, 2, 4, 5], [6]]
    stacked, alone = MuonEngine(net, MuonConfig()), MuonEngine(net, MuonConfig())
    generator = torch.Generator().manual_seed(1)
    scale = torch.tensor([4.0])  # as fp16's scaler holds it
    for _ in range(3):
        grads = {n: torch.randn(m.parameter.shape, generator=generator) for n, m in stacked.matrices.items()}
        for engine, calls in ((stacked, [stacked.names()]), (alone, [[n] for n in alone.names()])):
            for name, matrix in engine.matrices.items():
                matrix.parameter.grad = grads[name].to(matrix.parameter.dtype, copy=True)
            for names in calls:
                engine.orthogonalise(names, scale)
            engine.apply()
            engine.results = {n: m.parameter.grad.clone() for n, m in engine.matrices.items()}
        for name in stacked.names():
            torch.testing.assert_close(stacked.results[name], alone.results[name], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(stacked.state_dict()[name], alone.state_dict()[name], rtol=0, atol=0)


@pytest.mark.parametrize("pairs", [1, 3])
def test_one_group_costs_the_same_products_whatever_its_size(pairs):
    """The matrix products of a step (three per Newton–Schulz iteration) are one batched kernel
    each for all same-shape matrices: as many for three wide/tall pairs as for one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.__name__.split(".")[0] in ("mm", "bmm", "addmm", "baddbmm")
            return func(*args, **(kwargs or {}))

    net = nn.Sequential(*[nn.Linear(8, 16) if i % 2 else nn.Linear(16, 8) for i in range(2 * pairs)])
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    engine = MuonEngine(net, MuonConfig(ns_steps=5))
    with Products() as products:
        engine.orthogonalise(engine.names())
    assert products.count == 3 * 5


def test_a_step_not_applied_leaves_the_momentum_and_the_checkpoint_round_trips():
    net = nn.Linear(5, 3)
    engine = MuonEngine(net, MuonConfig(momentum=0.5))
    net.weight.grad = torch.ones(3, 5)
    engine.orthogonalise(["weight"])
    engine.apply()
    kept = engine.state_dict()["weight"].clone()
    assert torch.equal(kept, torch.full((3, 5), 0.5))
    engine.orthogonalise(["weight"], gradients=[torch.full((3, 5), float("inf"))])  # fp16 overflowed: no apply
    assert torch.equal(engine.state_dict()["weight"], kept)
    restored = MuonEngine(nn.Linear(5, 3), MuonConfig(momentum=0.5))
    restored.load_state_dict(engine.state_dict())
    assert torch.equal(restored.state_dict()["weight"], kept)
    with pytest.raises(ValueError, match="'weight': momentum of shape"):
        restored.load_state_dict({"weight": torch.zeros(5, 3)})


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_the_memory_model_counts_what_each_rank_holds(data_parallel):
    """Every rank holds each matrix's update; its momentum only where the rank orthogonalises it."""
    config = config_from_dict(
        {
            "model": tiny_model(),
            "pipeline": {"stages": 2, "micro_batches": 4, "data_parallel": data_parallel},
            "optimizer": {"name": "muon"},
        }
    )
    model = TinyRegression(config.model)
    topology = Topology(get_schedule("1f1b", 2, 4), data_parallel)
    skip = first_order_globs(model)
    states = []
    for stage in range(2):
        module = model.build_stage(stage, 2, seed=0)
        engine = MuonEngine(module, MuonConfig(), skip)
        states.append(
            StageState(
                tuple(p.numel() for p in unique_parameters(module)),
                tuple(MuonLayer(name, m.rows, m.cols) for name, m in engine.matrices.items()),
            )
        )
    modelled = rank_memory(
        topology,
        states,
        optimizer_state("muon", memory=methods()["muon"].memory),
        workers_per_layer=config.workers_per_layer,
    )
    for rank in range(topology.world_size):
        ((pipe, stage),) = topology.stages_of(rank)
        module = model.build_stage(stage, 2, seed=0)
        runtime = MuonRuntime(
            testing.method_inputs(config), topology, rank, {(pipe, stage): module}, comm=None, plan=None, skip=skip
        )
        engine = runtime.engines[(pipe, stage)]
        for name in runtime.own_share(stage):
            engine.orthogonalise([name], gradients=[torch.randn_like(engine.matrices[name].parameter)])
        for name in engine.names():
            engine.update_buffer(name)
        engine.apply()
        held = sum(
            t.numel() * t.element_size()
            for m in engine.matrices.values()
            for t in (m.buffer, m.update)
            if t is not None
        )
        assert held == modelled[rank].curvature_bytes
