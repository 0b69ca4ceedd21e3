"""Per-micro-batch operations: invariance to the split, pipeline-like order, memory release."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
from torch.nn.functional import mse_loss

from _kfac_models import data, layer_grad, tiny_mlp
from pipefisher.methods.kfac import FACTORS, KfacConfig, KFACEngine

NAMES = ("0", "2")


def factors_from_split(sizes: list[int], seed: int = 0) -> dict[tuple[str, str], torch.Tensor]:
    """Factors of 32 rows split into micro-batches of ``sizes``: all forwards first, backwards in
    reverse order, curvature calls shuffled (a pipeline may run them in any order). Each
    micro-batch loss is its row-sum scaled by 1/R (the batch mean), as a pipeline would use."""
    model = tiny_mlp()
    x, y = data(sum(sizes))
    engine = KFACEngine(model, KfacConfig(factor_decay=0.0))
    losses = []
    for mb, (xm, ym) in enumerate(zip(x.split(sizes), y.split(sizes))):
        with engine.capture(mb):
            losses.append(mse_loss(model(xm), ym, reduction="sum") / (y.numel()))
    for loss in reversed(losses):
        loss.backward()
    calls = [(n, f, mb) for n in NAMES for f in FACTORS for mb in range(len(sizes))]
    random.Random(seed).shuffle(calls)
    for call in calls:
        engine.curvature(*call)
    out = {}
    for n in NAMES:
        for f in FACTORS:
            engine.invert(n, f)
            out[n, f] = engine.factor(n, f)
    return out


@pytest.mark.parametrize("sizes", [[8, 8, 8, 8], [5, 11, 16]])
def test_curvature_over_micro_batches_equals_one_batch(sizes):
    whole = factors_from_split([32])
    split = factors_from_split(sizes, seed=len(sizes))
    for key, ref in whole.items():
        torch.testing.assert_close(split[key], ref, rtol=1e-12, atol=1e-15)


def test_equal_micro_batches_with_mean_over_m_scaling_match_one_batch():
    model = tiny_mlp()
    x, y = data(32)
    engine = KFACEngine(model, KfacConfig(factor_decay=0.0))
    for mb, (xm, ym) in enumerate(zip(x.split(8), y.split(8))):
        with engine.capture(mb):
            (mse_loss(model(xm), ym) / 4).backward()
        for n in NAMES:
            for f in FACTORS:
                engine.curvature(n, f, mb)
    whole = factors_from_split([32])
    for n in NAMES:
        for f in FACTORS:
            engine.invert(n, f)
            torch.testing.assert_close(engine.factor(n, f), whole[n, f], rtol=1e-12, atol=1e-15)


def test_curvature_frees_the_capture_and_release_drops_unused_ones():
    model = tiny_mlp()
    x, y = data(8)
    engine = KFACEngine(model)
    with engine.capture("mb0"):
        mse_loss(model(x), y).backward()
    with engine.capture("mb1"):
        model(x)
    ref = weakref.ref(engine._layers["2"].captures["A"]["mb0"][0])
    assert engine.captured("2", "A") == ["mb0", "mb1"] and engine.captured("2", "B") == ["mb0"]
    engine.curvature("2", "A", "mb0")
    gc.collect()
    assert ref() is None
    assert engine.captured("2", "A") == ["mb1"] and engine.built_rows("2", "A") == 8
    engine.release("2", "mb1")
    engine.release("0")
    assert engine.captured("2", "A") == [] and engine.captured("0", "A") == engine.captured("0", "B") == []
    with pytest.raises(KeyError, match="micro-batch 'mb1'"):
        engine.curvature("2", "A", "mb1")


def test_curvature_after_sync_and_invert_without_curvature_are_errors():
    model = tiny_mlp()
    x, y = data(8)
    engine = KFACEngine(model)
    for mb in (0, 1):
        with engine.capture(mb):
            mse_loss(model(x), y).backward()
    engine.curvature("0", "B", 0)
    engine.invert("0", "B")
    with pytest.raises(RuntimeError, match="no curvature"):
        engine.invert("0", "B")
    with pytest.raises(ValueError, match="factor"):
        engine.curvature("0", "C", 1)
    with pytest.raises(KeyError, match="not a K-FAC layer"):
        engine.curvature("1", "A", 1)


def test_new_inverses_take_effect_only_after_commit():
    model = tiny_mlp()
    x, y = data(8)
    engine = KFACEngine(model, KfacConfig(damping=0.1))
    with engine.capture(0):
        mse_loss(model(x), y).backward()
    for f in FACTORS:
        engine.curvature("2", f, 0)
        engine.invert("2", f)
    grad = layer_grad(model[2]).clone()
    engine.precondition("2")
    assert engine.inverse("2", "A") is None and torch.equal(layer_grad(model[2]), grad)
    engine.commit("2")
    engine.precondition("2")
    expected = engine.inverse("2", "B") @ grad @ engine.inverse("2", "A")
    torch.testing.assert_close(layer_grad(model[2]), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("count", [2, 3])
def test_factors_built_in_row_shares_and_summed_equal_the_whole(count):
    """Tensor parallelism: each of `count` sharers builds a factor from its share of every
    capture's rows; their sealed totals and row counts summed give the factor of all rows."""

    def engine_after_backward(share: int | None) -> KFACEngine:
        torch.manual_seed(0)
        model = tiny_mlp()
        x, y = data(32)
        engine = KFACEngine(model, KfacConfig(factor_decay=0.0), grad_scale=32)
        if share is not None:
            for name in NAMES:
                for factor in FACTORS:
                    engine.share_rows(name, factor, share, count)
        for mb, (xm, ym) in enumerate(zip(x.split(16), y.split(16))):
            with engine.capture(mb):
                (mse_loss(model(xm), ym, reduction="sum") / y.numel()).backward()
            for name in NAMES:
                for factor in FACTORS:
                    engine.curvature(name, factor, mb)
        return engine

    whole, shares = engine_after_backward(None), [engine_after_backward(index) for index in range(count)]
    for name in NAMES:
        for factor in FACTORS:
            parts = [engine.sync_tensors(name, factor) for engine in shares]
            assert all(rows.item() < 32 for _, rows in parts), "each sharer builds from part of the rows"
            total, rows = parts[0]
            for other_total, other_rows in parts[1:]:
                total.add_(other_total)
                rows.add_(other_rows)
            shares[0].invert(name, factor)
            whole.invert(name, factor)
            torch.testing.assert_close(
                shares[0].factor(name, factor), whole.factor(name, factor), rtol=1e-12, atol=1e-15
            )
