"""Factor sync over 2 real gloo ranks equals the factors of the concatenated data."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from _kfac_models import data, tiny_mlp
from pipefisher.methods.kfac import KFAC
from pipefisher.runtime.training.launch import run_group

pytestmark = pytest.mark.dist


def refreshed_factors(x: torch.Tensor, y: torch.Tensor, group) -> tuple[torch.nn.Module, KFAC, dict]:
    model = tiny_mlp()
    kfac = KFAC(model, factor_decay=0.0, kl_clip=1e-6, process_group=group)
    with kfac.capture():
        torch.nn.functional.mse_loss(model(x), y).backward()  # mean over this rank's rows
    kfac.update_curvature()
    kfac.update_inverses()
    return model, kfac, {(n, f): kfac.engine.factor(n, f) for n in ("0", "2") for f in "AB"}


def worker(rank: int, world: int) -> dict:
    """Data-parallel shard of 16 rows per rank: synced factors, plus a KL clip over the group."""
    x, y = data(32, seed=7)
    *_, whole = refreshed_factors(x, y, None)
    shard = slice(rank * 16, (rank + 1) * 16)
    model, kfac, synced = refreshed_factors(x[shard], y[shard], dist.group.WORLD)
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]
    report = kfac.engine.precondition_all(lr=0.1, group=dist.group.WORLD)
    local_vg = sum((p.grad * g).sum().item() for p, g in zip(params, grads)) / float(report.clip_scale)
    return {"whole": whole, "synced": synced, "report": report, "local_vg": local_vg}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_group(worker, 2, timeout=60, deadline=120)


def test_sync_over_two_ranks_equals_factors_of_concatenated_data(results):
    for out in results:
        for key, ref in out["whole"].items():
            torch.testing.assert_close(out["synced"][key], ref, rtol=1e-12, atol=1e-15)


def test_kl_clip_over_a_group_uses_the_summed_quadratic_form(results):
    vg = sum(out["local_vg"] for out in results)
    assert results[0]["local_vg"] != pytest.approx(results[1]["local_vg"])
    for out in results:
        vg_sum, clip_scale = float(out["report"].vg_sum), float(out["report"].clip_scale)
        assert vg_sum == pytest.approx(vg, rel=1e-9)
        assert clip_scale == pytest.approx(math.sqrt(1e-6 / (0.01 * vg)), rel=1e-9)
        assert clip_scale < 1.0
