"""A whole refresh and preconditioning read no tensor value on the host; checking health reads once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss

from _kfac_models import data, tiny_mlp
from host_reads import count_host_reads
from pipefisher.methods.kfac import FACTORS, KfacConfig, KFACEngine


def mlp(layers: int) -> torch.nn.Sequential:
    """``layers`` Linear(4, 4) with tanh between them, float32."""
    torch.manual_seed(layers)
    modules: list[torch.nn.Module] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(4, 4), torch.nn.Tanh()]
    return torch.nn.Sequential(*modules[:-1])


@pytest.fixture(scope="module")
def world() -> Iterator[dist.ProcessGroup]:
    """A real single-rank gloo group: the replica sums and the KL all-reduce are collectives."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def refresh(engine: KFACEngine, model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Capture two micro-batches (one under a device loss scale), then curvature, replica sum,
    inversion, inverse sharing and commit for every layer, as the pipeline runtime does."""
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    scale = torch.full((), 512.0)
    for mb, loss_scale in ((0, None), (1, scale)):
        with engine.capture(mb, loss_scale):
            loss = mse_loss(model(x), y)
            (loss if loss_scale is None else loss * loss_scale).backward()
    for info in engine.layers():
        for factor in FACTORS:
            for mb in (0, 1):
                engine.curvature(info.name, factor, mb)
            works = [dist.all_reduce(t, group=group, async_op=True) for t in engine.sync_tensors(info.name, factor)]
            for work in works:
                work.wait()
            engine.invert(info.name, factor)
            buffer = engine.inverse_buffer(info.name, factor)
            dist.broadcast(buffer.copy_(engine.shared_inverse(info.name, factor)), 0, group=group)
            engine.receive_inverse(info.name, factor, buffer)
        engine.commit(info.name)


@pytest.mark.parametrize("layers", [2, 6])
@pytest.mark.parametrize("kl_clip", [None, 1e-3])
def test_refresh_and_precondition_read_nothing_on_the_host(world, layers, kl_clip):
    model = mlp(layers)
    engine = KFACEngine(model, KfacConfig(factor_decay=0.5), kl_clip=kl_clip)
    with count_host_reads() as reads:
        for _ in range(2):  # the second refresh folds into the EMA and replaces inverses
            model.zero_grad()
            refresh(engine, model, world)
            report = engine.precondition_all(lr=0.1, group=world)
    assert not reads, dict(reads)
    assert (report.clip_scale is None) == (kl_clip is None)
    assert all(engine.inverse(info.name, f) is not None for info in engine.layers() for f in FACTORS)


@pytest.mark.parametrize("layers", [2, 6])
def test_check_health_reads_the_host_once_for_all_layers(world, layers):
    model = mlp(layers)
    engine = KFACEngine(model)
    refresh(engine, model, world)
    for inspect in (engine.check_health, engine.health):
        with count_host_reads() as reads:
            inspect()
        assert sum(reads.values()) == 1, dict(reads)


def test_preconditioning_with_no_successful_inverse_leaves_gradients_bit_identical():
    """Before any commit the inverses are missing; after a commit of failed inversions they are
    identity placeholders that must be skipped, not multiplied (``I @ -0.0`` gives ``+0.0``)."""
    model = tiny_mlp()
    x, y = data(8)
    engine = KFACEngine(model)

    def assert_untouched() -> None:
        for p in model.parameters():
            p.grad = torch.randn(p.shape, dtype=p.dtype)
            p.grad[0] = -0.0
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        engine.precondition_all()
        for name, p in model.named_parameters():
            assert torch.equal(p.grad.view(torch.int64), grads[name].view(torch.int64)), name

    assert_untouched()
    bad = x.clone()
    bad[0, 0] = float("nan")  # every factor of both layers is non-finite
    with engine.capture(0):
        mse_loss(model(bad), y).backward()
    for name in ("0", "2"):
        for factor in FACTORS:
            engine.curvature(name, factor, 0)
            engine.invert(name, factor)
        engine.commit(name)
        assert engine.inverse(name, "A") is None and engine.inverse(name, "B") is None
    assert_untouched()
