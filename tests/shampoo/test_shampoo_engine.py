"""The engine's task API: same-shape blocks stacked, checkpoints, root methods, numerical trouble, root sharing, settings,
host reads."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from host_reads import count_host_reads
from pipefisher.methods.shampoo import FACTORS, ShampooConfig, ShampooEngine, ShampooNumericsWarning


def tiny_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def set_gradients(model: nn.Module, seed: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale).to(p.dtype)


def refresh(engine: ShampooEngine) -> None:
    """Every task of one refresh, matrix by matrix, then commit and the health check."""
    for info in engine.matrices():
        engine.capture(info.name)
        for factor in FACTORS:
            engine.update_statistics(info.name, factor)
        engine.release(info.name)
        for factor in FACTORS:
            engine.compute_root(info.name, factor)
    engine.commit()
    engine.check_health()


def mid_cycle(engine: ShampooEngine, model: nn.Module) -> None:
    """A second cycle's captures, statistics and pending roots, matrix by matrix, nothing committed."""
    set_gradients(model, 1)
    for info in engine.matrices():
        engine.capture(info.name)
        for factor in FACTORS:
            engine.update_statistics(info.name, factor)
            engine.compute_root(info.name, factor)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


SETTINGS = ShampooConfig(beta2=0.95, epsilon=1e-6, block_size=4, grafting="adam")
#: the engine's values besides its section
GRAFT = {"graft_beta2": 0.9}


@pytest.mark.parametrize("held", [0, 2])
@pytest.mark.parametrize("stacked", [True, False])
def test_the_stacked_step_gives_each_block_its_own_roots_direction(stacked, held):
    """Three (6, 10) weights and a (10, 6) one cut into blocks of 4: the step stacks their
    same-shape blocks, and every block's direction is still its own ``L⁻¹ᐟ⁴ G R⁻¹ᐟ⁴`` rescaled to
    the norm of its SGD grafting block (its gradient), computed block by block here; stacked as on
    a GPU, or block by block as on a CPU; the first `held` matrices' products held by a P op
    before the step end (a group mixing held and computed blocks)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 6), nn.Linear(6, 10), nn.Linear(10, 6), nn.Linear(10, 6))
    engine = ShampooEngine(model, ShampooConfig(epsilon=1e-6, block_size=4, grafting="sgd"))
    engine.stack_blocks = stacked
    set_gradients(model, 0)
    refresh(engine)
    set_gradients(model, 1)
    before = dict(zip((name for name, _ in model.named_parameters()), grads(model)))
    engine.hold_products([info.name for info in engine.matrices()][:held])
    engine.precondition_all()
    checked = 0
    for info in engine.matrices():
        g = before[info.name].reshape(info.shape)
        got = dict(model.named_parameters())[info.name].grad.reshape(info.shape)
        left, right = engine.roots(info.name, "A"), engine.roots(info.name, "B")
        for k, rows, cols in info.grid():
            d = left[k] @ g[rows, cols] @ right[k]
            want = d * torch.linalg.vector_norm(g[rows, cols]) / torch.linalg.vector_norm(d)
            torch.testing.assert_close(got[rows, cols], want, rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == 4 * 6


def test_state_dict_round_trip_mid_refresh_resumes_bit_identically():
    model = tiny_model()
    engine = ShampooEngine(model, SETTINGS, **GRAFT)
    for step in range(2):
        set_gradients(model, step)
        refresh(engine)
        engine.precondition_all()
    # mid-refresh: a captured gradient still held, one factor folded, one root pending
    set_gradients(model, 2)
    engine.capture()
    engine.update_statistics("0.weight", "A")
    engine.compute_root("0.weight", "A")

    buffer = io.BytesIO()
    torch.save(engine.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    twin_model, blank_model = copy.deepcopy(model), copy.deepcopy(model)
    twin = ShampooEngine(twin_model, SETTINGS, **GRAFT)
    twin.load_state_dict(state)
    assert twin.step == 2
    blank = ShampooEngine(blank_model, SETTINGS, **GRAFT)  # no checkpoint: shows the comparison is not vacuous
    blank.capture()

    outputs = []
    for e, m in ((engine, model), (twin, twin_model), (blank, blank_model)):
        set_gradients(m, 2)
        e.update_statistics("0.weight", "B")
        e.compute_root("0.weight", "B")
        e.release("0.weight")
        for factor in FACTORS:
            e.update_statistics("2.weight", factor)
            e.compute_root("2.weight", factor)
        e.release("2.weight")
        e.commit()
        e.precondition_all()
        out = grads(m)
        set_gradients(m, 3)
        refresh(e)
        e.precondition_all()
        outputs.append(out + grads(m))
    resumed, blank_out = outputs[1], outputs[2]
    assert all(torch.equal(a, b) for a, b in zip(outputs[0], resumed))
    assert not any(torch.allclose(a, b) for a, b in zip(outputs[0], blank_out))


def test_load_state_dict_refuses_other_matrices():
    state = ShampooEngine(tiny_model(), SETTINGS, **GRAFT).state_dict()
    other = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4))
    with pytest.raises(ValueError, match="'2.weight'"):
        ShampooEngine(other, SETTINGS, **GRAFT).load_state_dict(state)


@pytest.mark.parametrize("dtype, epsilon, rtol", [(torch.float64, 1e-6, 1e-8), (torch.float32, 1e-3, 1e-4)])
def test_eigen_and_newton_roots_agree(dtype, epsilon, rtol):
    roots = {}
    for method in ("eigen", "newton"):
        model = tiny_model(dtype)
        engine = ShampooEngine(model, ShampooConfig(epsilon=epsilon, block_size=4, root=method), dtype=dtype)
        for step in range(3):
            set_gradients(model, step)
            refresh(engine)
        roots[method] = [r for info in engine.matrices() for f in FACTORS for r in engine.roots(info.name, f)]
    assert len(roots["eigen"]) == (4 + 4) + (2 + 2)
    for eigen, newton in zip(roots["eigen"], roots["newton"]):
        assert eigen.dtype == newton.dtype == dtype
        assert (eigen - newton).abs().max() <= rtol * eigen.abs().max()


def test_non_finite_gradient_keeps_statistics_and_roots_counts_and_warns_once():
    model = tiny_model()
    engine = ShampooEngine(model, SETTINGS, **GRAFT)
    set_gradients(model, 0)
    refresh(engine)
    before = {(i.name, f): [r.clone() for r in engine.roots(i.name, f)] for i in engine.matrices() for f in FACTORS}
    stats = [s.clone() for s in engine.statistics("0.weight", "A")]
    set_gradients(model, 1)
    model[0].weight.grad[1, 2] = float("nan")
    with pytest.warns(ShampooNumericsWarning, match=r"'0\.weight', factor [AB]: 1 statistics update"):
        refresh(engine)
    assert all(torch.equal(a, b) for a, b in zip(stats, engine.statistics("0.weight", "A")))
    for (name, factor), roots in before.items():
        same = all(torch.equal(a, b) for a, b in zip(roots, engine.roots(name, factor)))
        assert same == (name == "0.weight"), "the finite matrix refreshed its roots, the other kept them"
    assert engine.health()["0.weight"].skipped_statistics == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        refresh(engine)  # same matrix, same trouble: counted only
    assert engine.health()["0.weight"].skipped_statistics == 4


def test_failed_root_keeps_the_previous_one_and_without_one_the_block_takes_the_graft_direction():
    """Gradients of 1e30 overflow float32 statistics: every root of that matrix fails."""
    settings = ShampooConfig(epsilon=1e-6, block_size=4, grafting="none", statistics_dtype="float32")
    model = tiny_model()
    engine = ShampooEngine(model, settings)
    set_gradients(model, 0)
    model[2].weight.grad.mul_(1e30)
    with pytest.warns(
        ShampooNumericsWarning,
        match=r"'2\.weight', factor [AB]: 0 statistics update\(s\) skipped for a "
        r"non-finite gradient, 2 block root\(s\) failed",
    ):
        refresh(engine)
    assert engine.health()["2.weight"].skipped_roots == 4
    assert all(r.isnan().all() for r in engine.roots("2.weight", "A"))
    set_gradients(model, 1)
    expected = model[2].weight.grad.clone()
    engine.precondition_all()
    assert torch.equal(model[2].weight.grad, expected), "no valid root: the graft direction (G) is used"
    assert not torch.equal(model[0].weight.grad, expected)

    healthy_model = tiny_model()
    set_gradients(healthy_model, 0)
    healthy = ShampooEngine(healthy_model, settings)
    refresh(healthy)
    good = [r.clone() for r in healthy.roots("0.weight", "B")]
    set_gradients(healthy_model, 1, scale=1e30)
    with pytest.warns(ShampooNumericsWarning):
        refresh(healthy)
    assert all(torch.equal(a, b) for a, b in zip(good, healthy.roots("0.weight", "B")))


def test_received_roots_precondition_exactly_like_the_computed_ones():
    model = tiny_model()
    receiver_model = copy.deepcopy(model)
    source = ShampooEngine(model, SETTINGS, **GRAFT)
    receiver = ShampooEngine(receiver_model, SETTINGS, **GRAFT)
    set_gradients(model, 0)
    refresh(source)
    # pending roots exist only between compute_root and commit: share them then
    mid_cycle(source, model)
    for info in source.matrices():
        for factor in FACTORS:
            shared = source.shared_root(info.name, factor)
            assert shared.dim() == 1 and shared.is_contiguous() and shared.numel() == info.statistic_numel(factor)
            buffer = receiver.root_buffer(info.name, factor)
            assert buffer.shape == shared.shape and buffer.dtype == shared.dtype
            buffer.copy_(shared)
            receiver.receive_root(info.name, factor, buffer)
        source.release(info.name)
    source.commit()
    receiver.commit()
    for e, m in ((source, model), (receiver, receiver_model)):
        for _ in range(2):
            set_gradients(m, 5)
            e.precondition_all()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(receiver_model)))
    untouched = copy.deepcopy(model)
    set_gradients(untouched, 5)
    assert not torch.equal(grads(untouched)[0], grads(model)[0])


def test_a_received_failed_block_is_not_used():
    settings = ShampooConfig(epsilon=1e-6, block_size=4, grafting="none")
    model = tiny_model()
    engine = ShampooEngine(model, settings)
    engine.receive_root("0.weight", "A", torch.full((engine.matrices()[0].statistic_numel("A"),), float("nan")))
    engine.receive_root("0.weight", "B", torch.zeros(engine.matrices()[0].statistic_numel("B")))
    engine.commit()
    set_gradients(model, 0)
    expected = model[0].weight.grad.clone()
    engine.precondition_all()
    assert torch.equal(model[0].weight.grad, expected)
    with pytest.raises(ValueError, match="'0.weight': A roots of shape"):
        engine.receive_root("0.weight", "A", torch.zeros(3))


def test_tasks_read_nothing_on_the_host_and_the_health_check_reads_once():
    model = tiny_model()
    engine = ShampooEngine(model, SETTINGS, **GRAFT)
    other = ShampooEngine(copy.deepcopy(model), SETTINGS, **GRAFT)
    set_gradients(model, 0)
    with count_host_reads() as reads:
        engine.capture()
        for info in engine.matrices():
            engine.captured_gradient(info.name).mul_(2.0)
            for factor in FACTORS:
                engine.update_statistics(info.name, factor)
            engine.release(info.name)
    assert sum(reads.values()) == 0
    with count_host_reads() as reads:
        for info in engine.matrices():
            for factor in FACTORS:
                engine.compute_root(info.name, factor)
    assert sum(reads.values()) == 0
    with count_host_reads() as reads:
        engine.check_health()
    assert sum(reads.values()) == 1, "the health check reads every counter at once"
    with count_host_reads() as reads:
        for info in engine.matrices():
            for factor in FACTORS:
                other.receive_root(info.name, factor, engine.shared_root(info.name, factor).clone())
        engine.commit()
        other.commit()
        engine.precondition_all()
        engine.precondition_all()
    assert sum(reads.values()) == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("beta2", 0.0),
        ("beta2", 1.5),
        ("epsilon", 0.0),
        ("epsilon", float("inf")),
        ("block_size", 0),
        ("block_size", 2.5),
        ("root", "cholesky"),
        ("grafting", "adagrad"),
        ("graft_beta2", 1.0),
        ("graft_epsilon", -1.0),
        ("start_step", -1),
        ("dtype", torch.bfloat16),
        ("statistics_dtype", "bfloat16"),
    ],
)
def test_settings_validation_names_the_field(field, value):
    """A run-file key is named as the run file names it (shampoo.key), the engine's own values by their name."""
    own = field in ("graft_beta2", "graft_epsilon", "dtype")
    with pytest.raises(ValueError, match=f"^{field} must" if own else rf"^shampoo\.{field}: "):
        ShampooEngine(tiny_model(), **({field: value} if own else {"settings": ShampooConfig(**{field: value})}))


def test_unknown_names_and_factors_and_missing_captures_are_refused():
    engine = ShampooEngine(tiny_model(), SETTINGS, **GRAFT)
    with pytest.raises(KeyError, match="'0.bias' is not a Shampoo matrix"):
        engine.capture("0.bias")
    with pytest.raises(ValueError, match="factor must be 'A' or 'B'"):
        engine.compute_root("0.weight", "C")
    with pytest.raises(RuntimeError, match="no captured gradient"):
        engine.update_statistics("0.weight", "A")
    with pytest.raises(RuntimeError, match="no pending A roots"):
        engine.shared_root("0.weight", "A")


@pytest.mark.parametrize("helpers", [False, True])
def test_the_memory_model_counts_what_the_engine_holds_at_a_cycles_peak(helpers):
    """Mid-cycle: statistics, roots in use and pending, the captured gradient, Adam grafting's
    second moment and, with helpers, the P op's held products."""
    from pipefisher.methods.shampoo.memory import ShampooLayer
    from pipefisher.runtime.training.checkpoint import tensor_bytes

    model = tiny_model()
    settings = ShampooConfig(beta2=0.95, epsilon=1e-6, block_size=4, grafting="adam", helpers=helpers)
    engine = ShampooEngine(model, settings, matrices_only=True, **GRAFT)
    set_gradients(model, 0)
    refresh(engine)
    mid_cycle(engine, model)
    names = [info.name for info in engine.matrices()]
    if helpers:
        engine.hold_products(names)
    held = sum(engine.product_buffer(name).nbytes for name in names) if helpers else 0
    layers = [
        ShampooLayer(info.name, *info.shape, block_size=4, adam_grafting=True, helpers=helpers)
        for info in engine.matrices()
    ]
    assert tensor_bytes(engine.state_dict()) + held == sum(layer.state_bytes() for layer in layers)
