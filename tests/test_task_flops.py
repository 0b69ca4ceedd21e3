"""Each built-in method's flop counts (`CurvatureMethod.task_flops`) against torch's flop counter
around the task as its profiler times it: the matrix products match exactly, and the
decompositions take the counts `pipefisher.methods.flops` states."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from pipefisher.methods.flops import CHOLESKY, EIGH, QR, TRIANGULAR_SOLVE, MatrixShape
from pipefisher.methods.kfac.factors import accumulate_covariance, damped_inverse, precondition_matrix
from pipefisher.methods.kfac.engine import KFACEngine
from pipefisher.methods.kfac.method import KfacConfig
from pipefisher.methods.muon.engine import MuonEngine
from pipefisher.methods.muon.method import MuonConfig
from pipefisher.methods.registry import method
from pipefisher.methods.shampoo.engine import ShampooEngine
from pipefisher.methods.shampoo.method import ShampooConfig
from pipefisher.methods.soap.engine import SoapEngine
from pipefisher.methods.soap.method import SoapConfig


def _inplace(op):
    """torch's count of `op` for its in-place variant (the counter knows only ``addmm``, not ``addmm_``)."""

    def count(*args, **kwargs):
        return flop_registry[op](*args, **kwargs)

    count._get_raw = True  # already takes tensors, as the registry's own entries do
    return count


INPLACE = {
    torch.ops.aten.addmm_: _inplace(torch.ops.aten.addmm),
    torch.ops.aten.baddbmm_: _inplace(torch.ops.aten.baddbmm),
}


def counted(work) -> int:
    """The flops torch's counter sees in `work()`: matrix products, in place or not."""
    with FlopCounterMode(display=False, custom_mapping=INPLACE) as counter:
        work()
    return counter.get_total_flops()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("inverse", ["eigen", "cholesky"])
def test_kfac_counts_its_products_and_states_its_decompositions(bias, inverse):
    d_in, d_out, tokens = 12, 7, 20
    settings = KfacConfig(inverse=inverse)
    flops = method("kfac").task_flops(settings, MatrixShape(d_out, d_in, bias), tokens)
    a = d_in + int(bias)
    factor_a, factor_b = torch.zeros(a, a), torch.zeros(d_out, d_out)
    inputs, grads = torch.randn(tokens, d_in), torch.randn(tokens, d_out)
    assert counted(lambda: accumulate_covariance(factor_a, inputs, bias)) == flops["curvature.0"].total
    assert counted(lambda: accumulate_covariance(factor_b, grads, False)) == flops["curvature.1"].total
    per_n3 = EIGH if inverse == "eigen" else CHOLESKY + TRIANGULAR_SOLVE
    for part, n in enumerate((a, d_out)):
        task = flops[f"refresh.{part}"]
        spd = torch.randn(n, n) @ torch.randn(n, n).T + n * torch.eye(n)
        assert counted(lambda: damped_inverse(spd, settings.damping, inverse)) == task.matmul
        assert task.decomposition == pytest.approx(per_n3 * n**3) and task.dtype == "float32"
    a_inv, b_inv, grad = torch.eye(a), torch.eye(d_out), torch.randn(d_out, a)
    assert counted(lambda: precondition_matrix(grad, a_inv, b_inv)) == flops["precondition"].total
    assert {task.dtype for task in flops.values()} == {"float32"}
    float64 = method("kfac").task_flops(settings, MatrixShape(d_out, d_in, bias, "float64"), tokens)
    assert {task.dtype for task in float64.values()} == {"float64"}


@pytest.mark.parametrize("approximation", ["expand", "reduce"])
def test_kfac_curvature_counts_the_rows_its_approximation_reads(approximation):
    sequences, positions, d_in, d_out = 3, 8, 12, 7
    model = nn.Sequential(nn.Linear(d_in, d_out, bias=False))
    engine = KFACEngine(model, KfacConfig(approximation=approximation))
    with engine.capture(0):
        model(torch.randn(sequences, positions, d_in)).square().sum().backward()
    shape, tokens = MatrixShape(d_out, d_in, False), sequences * positions
    flops = method("kfac").task_flops(engine.config, shape, tokens, sequences)
    for part, factor in enumerate("AB"):
        assert counted(lambda: engine.curvature("0", factor, 0)) == flops[f"curvature.{part}"].total
    rows = sequences if approximation == "reduce" else tokens
    assert flops["curvature.1"].total == 2 * rows * d_out**2


@pytest.mark.parametrize("root", ["eigen", "newton"])
def test_shampoo_counts_statistics_and_roots_of_every_block(root):
    settings = ShampooConfig(block_size=4, root=root, statistics_dtype="float64")
    layer = nn.Linear(10, 6, bias=False)  # rows 6 = 4 + 2, cols 10 = 4 + 4 + 2: six blocks
    engine = ShampooEngine(layer, settings)
    layer.weight.grad = torch.randn_like(layer.weight)
    engine.capture("weight")
    flops = method("shampoo").task_flops(settings, MatrixShape(6, 10), tokens=5)
    for part, factor in enumerate(("A", "B")):

        def refresh(factor=factor) -> None:
            engine.update_statistics("weight", factor)
            engine.compute_root("weight", factor)

        assert counted(refresh) == flops[f"refresh.{part}"].matmul
    sides = {"refresh.0": [4, 4, 4, 2, 2, 2], "refresh.1": [4, 4, 2] * 2}
    for key, sizes in sides.items():
        expected = sum(EIGH * n**3 for n in sizes) if root == "eigen" else 0.0
        assert flops[key].decomposition == pytest.approx(expected)
        assert flops[key].dtype == "float64"


def test_soap_counts_the_power_step_and_states_the_qr_and_counts_the_fold():
    settings = SoapConfig(block_size=4)
    layer = nn.Linear(6, 5, bias=False)  # rows 5 = 4 + 1, cols 6 = 4 + 2
    engine = SoapEngine(layer, settings)
    layer.weight.grad = torch.randn_like(layer.weight)
    engine.precondition_all()
    engine.snapshot()
    flops = method("soap").task_flops(settings, MatrixShape(5, 6), tokens=5)
    for part, (factor, sizes) in enumerate((("A", [4, 4, 1, 1]), ("B", [4, 2, 4, 2]))):
        task = flops[f"refresh.{part}"]
        assert counted(lambda factor=factor: engine.refresh("weight", factor)) == task.matmul
        assert task.decomposition == pytest.approx(sum(QR * n**3 for n in sizes))
        assert task.dtype == settings.statistics_dtype
    assert "fold" not in flops, "at fold: step-end the fold is part of the step end"
    in_bubbles = method("soap").task_flops(SoapConfig(block_size=4, fold="bubbles"), MatrixShape(5, 6), tokens=5)
    gradient = torch.randn(5, 6)
    assert counted(lambda: engine.fold_into_statistics("weight", gradient)) == in_bubbles["fold"].total
    assert in_bubbles["fold"].dtype == settings.statistics_dtype and "precondition" not in in_bubbles


@pytest.mark.parametrize("helpers", [False, True])
@pytest.mark.parametrize("fold", ["step-end", "bubbles"])
def test_soaps_optimizer_step_is_its_step_end_count(fold, helpers):
    """The step end after the first (which only starts the bases): the rotations, and at
    step-end the fold; with ``fold: bubbles`` the U op folds the held gradient apart; with
    `helpers` the P op rotates the gradient in (``precondition``) and the step end only out."""
    settings = SoapConfig(block_size=4, fold=fold, helpers=helpers)
    layer = nn.Linear(6, 5, bias=False)  # rows 5 = 4 + 1, cols 6 = 4 + 2
    engine = SoapEngine(layer, settings, defer_statistics=fold == "bubbles")  # as the runtime builds it
    layer.weight.grad = torch.randn_like(layer.weight)
    engine.precondition_all()
    engine.fold_held()
    layer.weight.grad = torch.randn_like(layer.weight)
    flops = method("soap").task_flops(settings, MatrixShape(5, 6), tokens=5)
    if helpers:
        assert counted(lambda: engine.hold_rotations(["weight"])) == flops["precondition"].total > 0
    else:
        assert "precondition" not in flops
    assert counted(engine.precondition_all) == flops["step_end"].total > 0
    assert flops["step_end"].dtype == "float32"
    if fold == "bubbles":
        assert counted(engine.fold_held) == flops["fold"].total > 0


def test_shampoos_optimizer_step_is_its_step_end_count():
    settings = ShampooConfig(block_size=4)
    layer = nn.Linear(10, 6, bias=False)
    engine = ShampooEngine(layer, settings)
    layer.weight.grad = torch.randn_like(layer.weight)
    engine.capture("weight")
    for factor in ("A", "B"):
        engine.update_statistics("weight", factor)
        engine.compute_root("weight", factor)
    engine.commit()
    flops = method("shampoo").task_flops(settings, MatrixShape(6, 10), tokens=5)
    assert counted(engine.precondition_all) == flops["step_end"].total > 0


@pytest.mark.parametrize(("rows", "cols"), [(8, 20), (20, 8)])
def test_muon_counts_every_newton_schulz_step(rows, cols):
    settings = MuonConfig(ns_steps=3)
    layer = nn.Linear(cols, rows, bias=False)
    engine = MuonEngine(layer, settings)
    gradient = torch.randn(rows, cols)
    flops = method("muon").task_flops(settings, MatrixShape(rows, cols), tokens=5)
    assert counted(lambda: engine.orthogonalise(["weight"], gradients=[gradient])) == flops["precondition"].total
    assert flops["precondition"].dtype == "float32" and set(flops) == {"precondition"}


def test_a_method_that_declares_no_flops_has_none():
    from dataclasses import replace

    assert replace(method("kfac"), flops="").task_flops(KfacConfig(), MatrixShape(4, 4), 8) == {}
