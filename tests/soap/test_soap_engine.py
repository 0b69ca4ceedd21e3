"""The engine's task API: same-shape blocks stacked, the eigenbasis of a null space, shared bases, host reads, numerical
trouble, checkpoints mid-cycle, the memory model and the settings."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from host_reads import count_host_reads
from rounding import sums_in_two_orders
from pipefisher.config import ConfigError, config_from_dict
from pipefisher.methods.blocks import FACTORS
from pipefisher.methods.soap import SoapConfig, SoapEngine, SoapNumericsWarning
from pipefisher.methods.soap import basis as soap_basis
from pipefisher.methods.soap.memory import SoapLayer
from pipefisher.runtime.training.checkpoint import tensor_bytes

SETTINGS = SoapConfig(block_size=4)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Embedding(4, 3))


def set_gradients(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def refresh(engine: SoapEngine) -> None:
    """A cycle's end as the pipeline has it: every refresh, the commit, the next snapshot."""
    for info in engine.matrices():
        for factor in FACTORS:
            engine.refresh(info.name, factor)
    engine.commit()
    engine.snapshot()


def run(engine: SoapEngine, model: nn.Module, seeds: range) -> None:
    for seed in seeds:
        set_gradients(model, seed)
        engine.precondition_all()
        refresh(engine)


def test_matrices_are_the_2d_weights_but_embedding_tables_and_skipped_names():
    engine = SoapEngine(tiny_model(), SETTINGS, skip=("2.*",))
    assert [(info.name, info.row_blocks, info.col_blocks) for info in engine.matrices()] == [
        ("0.weight", (4, 3), (4, 1))
    ]


@pytest.mark.parametrize("stacked", [True, False])
def test_same_shape_blocks_of_many_matrices_step_as_one_stack_and_equal_one_matrix_at_a_time(stacked):
    """Three (6, 10) weights and a (10, 6) one cut into blocks of 4 (shapes 4x4, 4x2, 2x4, 2x2
    shared across the matrices): the stacked step over all of them (a non-finite gradient of one
    matrix in the last step included, which leaves its statistics alone) gives the directions, statistics and moments
    of stepping each matrix alone, over several steps and refreshes; stacked as on a GPU, or block
    by block as on a CPU."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(10, 6), nn.Linear(6, 10), nn.Linear(10, 6), nn.Linear(10, 6))

    together, alone = model(), model()
    engines = SoapEngine(together, SETTINGS), SoapEngine(alone, SETTINGS)
    assert not engines[0].stack_blocks, "a CPU steps block by block"
    engines[0].stack_blocks = stacked
    for seed in range(4):
        for net, engine in zip((together, alone), engines):
            set_gradients(net, seed)
            if seed == 3:
                net[1].weight.grad[0, 0] = float("nan")
        engines[0].precondition_all()
        for p in engines[1].parameters():
            engines[1].precondition_all(keep=lambda q, p=p: q is p)
        for engine in engines:
            refresh(engine)
        for (name, mine), theirs in zip(together.named_parameters(), alone.parameters()):
            # float32 eigenbases, batched against one at a time (LAPACK's paths round differently on
            # AVX-512): equal to about 1e-6 of the directions' scale (about 1)
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)
    for info in engines[0].matrices():
        for factor in FACTORS:
            for mine, theirs in zip(engines[0].statistics(info.name, factor), engines[1].statistics(info.name, factor)):
                torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    assert engines[0].health()["1.weight"].skipped_statistics == 1
    assert engines[0].health() == engines[1].health()


@pytest.mark.parametrize("tie_break, same", [(soap_basis.TIE_BREAK, True), (0.0, False)])
def test_a_gradient_summed_in_another_order_gives_the_same_direction(monkeypatch, tie_break, same):
    """A 16 x 3 gradient leaves a 13-dimensional null space in its left statistic, whose
    eigenbasis a plain decomposition takes from rounding: replicas that sum the micro-batches in
    another order would then step differently. The tie-break fixes it (not vacuous: without it
    the directions differ)."""
    monkeypatch.setattr(soap_basis, "TIE_BREAK", tie_break)
    in_sequence, by_halves, following = sums_in_two_orders(16, 3)
    directions = []
    for gradient in (in_sequence, by_halves):
        layer = nn.Linear(3, 16, bias=False)
        engine = SoapEngine(layer)
        for g in (gradient, following):
            layer.weight.grad = g.clone()
            engine.precondition_all()
        directions.append(layer.weight.grad)
    close = torch.allclose(directions[0], directions[1], rtol=0, atol=1e-4 * directions[0].abs().max().item())
    assert close == same


def test_received_bases_step_exactly_like_the_computed_ones_and_the_first_cycle_sends_nothing():
    model = tiny_model()
    computing, receiving = SoapEngine(model, SETTINGS), SoapEngine(copy.deepcopy(model), SETTINGS)
    twin = receiving.parameters()[0]
    for seed in range(3):
        set_gradients(model, seed)
        twin.grad = model[0].weight.grad.clone()
        computing.precondition_all()
        receiving.precondition_all()
        for info in computing.matrices():
            for factor in FACTORS:
                computing.refresh(info.name, factor)
                receiving.receive_basis(info.name, factor, computing.shared_basis(info.name, factor).clone())
        if seed == 0:
            assert computing.basis("0.weight", "A") is not None and computing.statistics("0.weight", "A")
            assert all(
                fs.pending is None
                for e in (computing, receiving)
                for st in e._matrices.values()
                for fs in st.factors.values()
            )
        for engine in (computing, receiving):
            engine.commit()
            engine.snapshot()
    assert all(torch.equal(a, b) for a, b in zip(computing.basis("0.weight", "B"), receiving.basis("0.weight", "B")))
    set_gradients(model, 9)
    twin.grad = model[0].weight.grad.clone()
    computing.precondition_all()
    receiving.precondition_all()
    assert torch.equal(model[0].weight.grad, twin.grad)
    with pytest.raises(ValueError, match="'0.weight': A basis of 3 elements"):
        receiving.receive_basis("0.weight", "A", torch.zeros(3))


def test_the_step_end_and_the_refresh_read_nothing_on_the_host_and_the_health_check_reads_once():
    model = tiny_model()
    engine = SoapEngine(model, SETTINGS)
    set_gradients(model, 0)
    with count_host_reads() as reads:
        for seed in range(3):
            engine.precondition_all()
            refresh(engine)
    assert sum(reads.values()) == 0
    with count_host_reads() as reads:
        engine.check_health()
    assert sum(reads.values()) == 1, "the health check reads every counter at once"


def test_a_non_finite_gradient_keeps_the_statistics_and_bases_counts_and_warns_once():
    model = tiny_model()
    engine = SoapEngine(model, SETTINGS)
    run(engine, model, range(2))
    before = [s.clone() for s in engine.statistics("0.weight", "A")]
    set_gradients(model, 2)
    model[0].weight.grad[0, 0] = float("nan")
    engine.precondition_all()
    refresh(engine)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.statistics("0.weight", "A")))
    assert engine.health()["0.weight"].skipped_statistics == 1
    assert all(torch.isfinite(b).all() for f in FACTORS for b in engine.basis("0.weight", f))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.check_health()
        engine.check_health()
    assert [type(w.message) for w in caught] == [SoapNumericsWarning]


def test_a_state_dict_taken_mid_cycle_resumes_bit_identically():
    model = tiny_model()
    engine = SoapEngine(model, SETTINGS)
    run(engine, model, range(2))
    set_gradients(model, 2)
    engine.precondition_all()
    engine.refresh("0.weight", "A")  # mid-cycle: one factor's basis pending
    restored_model = copy.deepcopy(model)
    restored = SoapEngine(restored_model, SETTINGS)
    restored.load_state_dict(copy.deepcopy(engine.state_dict()))
    for e, m in ((engine, model), (restored, restored_model)):
        e.refresh("0.weight", "B")
        e.commit()
        e.snapshot()
        set_gradients(m, 3)
        e.precondition_all()
    assert torch.equal(model[0].weight.grad, restored_model[0].weight.grad)
    with pytest.raises(ValueError, match="SOAP matrices differ"):
        SoapEngine(nn.Linear(5, 7), SETTINGS).load_state_dict(engine.state_dict())


@pytest.mark.parametrize("helpers", [False, True])
@pytest.mark.parametrize("deferred", [False, True])
def test_the_memory_model_counts_what_the_engine_holds_after_a_commit(deferred, helpers):
    """With deferred statistics: and the gradients held from the step end to their fold; with
    helpers: and the next step's rotated gradients, held from its P op (one matrix here, the
    other's from a helper) to its step end."""
    model = nn.Sequential(nn.Linear(9, 6, bias=False), nn.Linear(6, 2, bias=False))
    engine = SoapEngine(model, SETTINGS, defer_statistics=deferred)
    run(engine, model, range(2))
    set_gradients(model, 2)
    engine.precondition_all()
    if helpers:
        set_gradients(model, 3)
        engine.hold_rotations(["0.weight"], received=["1.weight"])
    held = engine.held_gradient_bytes + engine.held_rotation_bytes
    assert (engine.held_gradient_bytes > 0, engine.held_rotation_bytes > 0) == (deferred, helpers)
    layers = [
        SoapLayer(info.name, *info.shape, block_size=4, deferred_statistics=deferred, helpers=helpers)
        for info in engine.matrices()
    ]
    assert tensor_bytes(engine.state_dict()) + held == sum(layer.state_bytes() for layer in layers)


def deferred_and_at_the_step_end(fold_at: str) -> tuple[SoapEngine, SoapEngine, nn.Module, nn.Module]:
    """Two engines over copies of one model through 7 steps and cycles of 3 (the refresh at each
    cycle's second step, as a packer may put it): one folds at each step end, the other holds the
    gradient and folds it at `fold_at`: "next-step" (the U op at the next step's start, before the
    cycle's refresh), "never" (only what reads the statistics folds)."""
    models = (tiny_model(), tiny_model())
    engines = (SoapEngine(models[0], SETTINGS), SoapEngine(models[1], SETTINGS, defer_statistics=True))
    for step in range(7):
        for engine, model in zip(engines, models):
            if fold_at == "next-step" and engine.defer_statistics:
                engine.fold_held()
            if step % 3 == 1:
                for info in engine.matrices():
                    for factor in FACTORS:
                        engine.refresh(info.name, factor)
            set_gradients(model, step)
            engine.precondition_all()
            if step % 3 == 2:
                engine.commit()
                engine.snapshot()
    return (*engines, *models)


@pytest.mark.parametrize("fold_at", ["next-step", "never"])
def test_statistics_folded_in_the_next_step_give_the_same_directions_statistics_and_checkpoint(fold_at):
    """Deferral moves when the fold runs, never what it computes: every direction, statistic,
    basis and the checkpoint (taken with a gradient held and a snapshot due) are bit-identical."""
    at_end, deferred, model_at_end, model_deferred = deferred_and_at_the_step_end(fold_at)
    assert deferred.held_gradient_bytes > 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model_at_end.parameters(), model_deferred.parameters()))
    ours, theirs = deferred.state_dict(), at_end.state_dict()
    assert deferred.held_gradient_bytes == 0, "the checkpoint folds what is held"
    assert flat(ours).keys() == flat(theirs).keys()
    for key, value in flat(theirs).items():
        assert torch.equal(value, flat(ours)[key]) if isinstance(value, torch.Tensor) else value == flat(ours)[key], key


def flat(state: dict, prefix: str = "") -> dict:
    """A nested state dict as {"a/b/c": leaf}."""
    found = {}
    for key, value in state.items():
        if isinstance(value, dict):
            found.update(flat(value, f"{prefix}{key}/"))
        else:
            found[f"{prefix}{key}"] = value
    return found


@pytest.mark.parametrize(
    "field, value",
    [
        ("beta1", 1.0),
        ("beta2", -0.1),
        ("statistics_beta", 1.0),
        ("epsilon", 0.0),
        ("block_size", 0),
        ("dtype", torch.float16),
        ("statistics_dtype", "float16"),
    ],
)
def test_settings_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SoapEngine(
            tiny_model(), **({"dtype": value} if field == "dtype" else {"settings": SoapConfig(**{field: value})})
        )


def test_zero1_is_refused_in_one_line():
    with pytest.raises(
        ConfigError, match="^optimizer.zero: soap keeps every replica's statistics .* use optimizer.zero 0, 2 or 3$"
    ):
        config_from_dict({"optimizer": {"name": "soap", "zero": 1}, "pipeline": {"data_parallel": 2}})


def original_basis_moment(engine: SoapEngine, name: str) -> torch.Tensor:
    """``Q_L m Q_Rᵀ`` per block: the first moment in the parameter's own basis (float64)."""
    info = next(info for info in engine.matrices() if info.name == name)
    state = engine.state_dict()["matrices"][name]
    left, right = engine.basis(name, "A"), engine.basis(name, "B")
    out = torch.empty(info.shape, dtype=torch.float64)
    for k, rows, cols in info.grid():
        out[rows, cols] = left[k].double() @ state["exp_avg"][rows, cols].double() @ right[k].double().mT
    return out


def test_the_first_moment_kept_in_the_eigenbasis_is_the_gradients_average_in_every_basis():
    """Five steps with a refresh and commit after each (the bases turn every time): rotated back,
    the moment equals the exponential average of the gradients since the first direction,
    computed here in float64 in the parameter's basis."""
    model = tiny_model()
    engine = SoapEngine(model, SETTINGS)
    expected = torch.zeros(7, 5, dtype=torch.float64)
    for seed in range(5):
        set_gradients(model, seed)
        if seed:  # the first step takes the first bases and no direction
            expected.lerp_(model[0].weight.grad.double(), 1 - SETTINGS.beta1)
        before = engine.basis("0.weight", "A")
        before = None if before is None else [b.clone() for b in before]
        engine.precondition_all()
        refresh(engine)
        if before is not None and seed >= 2:
            turned = max((a - b).abs().max().item() for a, b in zip(before, engine.basis("0.weight", "A")))
            assert turned > 1e-3, "the commit changed the bases: the rotation is exercised"
        torch.testing.assert_close(original_basis_moment(engine, "0.weight"), expected, rtol=1e-5, atol=1e-6)


def test_an_entry_with_the_moment_in_the_original_basis_loads_rotated_into_the_eigenbasis():
    """Checkpoints written before the moment moved into the eigenbasis hold it in the parameter's
    basis and say nothing of it: loading rotates it in, and the next direction is the same."""
    model = tiny_model()
    engine = SoapEngine(model, SETTINGS)
    run(engine, model, range(3))
    entry = copy.deepcopy(engine.state_dict())
    old = entry["matrices"]["0.weight"]
    del old["moments"]
    old["exp_avg"] = original_basis_moment(engine, "0.weight").float()
    restored_model = copy.deepcopy(model)
    restored = SoapEngine(restored_model, SETTINGS)
    restored.load_state_dict(entry)
    torch.testing.assert_close(
        restored.state_dict()["matrices"]["0.weight"]["exp_avg"],
        engine.state_dict()["matrices"]["0.weight"]["exp_avg"],
        rtol=1e-5,
        atol=1e-6,
    )
    for e, m in ((engine, model), (restored, restored_model)):
        set_gradients(m, 3)
        e.precondition_all()
    torch.testing.assert_close(restored_model[0].weight.grad, model[0].weight.grad, rtol=1e-5, atol=1e-6)
