"""`torch.optim.Muon` (torch 2.13) as the oracle of Muon's maths: several steps of a small model
with non-square matrices (wide and tall, same-shape ones stacked), weight decay, Nesterov or not, both shape scales. With
the bfloat16 iteration (torch's) our engine and step give torch's parameters (to the bit where
the shape scale is 1); the float32 iteration (our default) is torch's up to bfloat16's rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.functional import mse_loss
from torch.optim._muon import _zeropower_via_newtonschulz

from pipefisher.methods.muon.engine import MuonEngine
from pipefisher.methods.muon.method import MuonConfig
from pipefisher.methods.muon.newton_schulz import orthogonalise
from pipefisher.methods.muon.optimizer import MuonStep

LR, DECAY, STEPS = 0.02, 0.1, 5


def model() -> nn.Module:
    torch.manual_seed(0)
    # two square matrices and a tall/wide pair: the engine orthogonalises each pair as one stack
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, 6), nn.Linear(6, 3)
    )


def train_ours(net: nn.Module, settings: MuonConfig, data) -> None:
    engine = MuonEngine(net, settings)
    step = MuonStep([m.parameter for m in engine.matrices.values()], lr=LR, weight_decay=DECAY)
    for x, y in data:
        net.zero_grad()
        mse_loss(net(x), y).backward()
        engine.orthogonalise(engine.names())
        engine.apply()
        step.step()


def train_torch(net: nn.Module, data, **options) -> None:
    optimizer = torch.optim.Muon([p for p in net.parameters() if p.dim() == 2], lr=LR, weight_decay=DECAY, **options)
    for x, y in data:
        net.zero_grad()
        mse_loss(net(x), y).backward()
        optimizer.step()


def batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator)) for _ in range(STEPS)]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_bfloat16_muon_equals_torch(nesterov, adjust_lr):
    """To the bit where the shape scale is 1 (the wide and square matrices under ``original``);
    elsewhere s·O is rounded to float32 before the step, which torch folds into lr."""
    ours, theirs = model(), model()
    train_ours(ours, MuonConfig(momentum=0.9, nesterov=nesterov, ns_dtype="bfloat16", adjust_lr=adjust_lr), batches())
    train_torch(theirs, batches(), momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr)
    start = model()
    for (name, mine), reference, initial in zip(ours.named_parameters(), theirs.parameters(), start.parameters()):
        if mine.dim() == 2:
            assert not torch.equal(mine, initial), f"{name} moved"
            exact = adjust_lr == "original" and mine.shape[0] <= mine.shape[1]
            torch.testing.assert_close(mine, reference, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7, msg=name)


@pytest.mark.parametrize("shape", [(12, 6), (3, 12), (64, 64)])
def test_the_float32_iteration_is_torchs_up_to_its_bfloat16_rounding(shape):
    """torch iterates in bfloat16 (8 significant bits, rounded at every product): its result is
    about 2 % from the float32 one in Frobenius norm."""
    update = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    ours = orthogonalise(update, MuonConfig())
    theirs = _zeropower_via_newtonschulz(update, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    assert ours.dtype == torch.float32
    assert torch.linalg.norm(ours - theirs) < 0.04 * torch.linalg.norm(ours)


@pytest.mark.parametrize("shape", [(8, 20), (20, 8), (12, 12)])
def test_the_iteration_leaves_singular_values_near_one(shape):
    """Independent of torch's code: the SVD of the result (float64) of a random matrix."""
    update = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    result = orthogonalise(update, MuonConfig(ns_dtype="float64"))
    singular = torch.linalg.svdvals(result)
    assert singular.min() > 0.6 and singular.max() < 1.25, singular
    u, _, vh = torch.linalg.svd(update, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(result.flatten(), (u @ vh).flatten(), dim=0) > 0.98, (
        "the polar factor's direction"
    )


def test_a_muon_runs_optimizer_is_torch_muon_for_the_matrices_and_adamw_for_the_rest():
    """The run's optimizer (`build_optimizer` with Muon's parts: its matrices, `MuonStep` at
    muon.lr, AdamW at optimizer.lr for embeddings' biases and norms) after the reference twin's
    hooks, against `torch.optim.Muon` and `torch.optim.AdamW` on a copy of the tiny transformer,
    step by step."""
    from builders import tiny_model
    from pipefisher import testing
    from pipefisher.config import config_from_dict
    from pipefisher.methods.registry import method_of
    from pipefisher.runtime.training.optimizer import build_optimizer
    from pipefisher.optim.first_order import no_decay
    from pipefisher.runtime.training.assembly import data_source, staged_model

    config = config_from_dict(
        {
            "model": tiny_model(),
            "data": {"micro_batch_size": 4},
            "pipeline": {"stages": 1, "micro_batches": 1},
            "optimizer": {"name": "muon", "lr": 3e-3, "weight_decay": 0.1, "eps": 1e-3},
            "muon": {"lr": LR, "momentum": 0.9, "ns_dtype": "bfloat16"},
        }
    )
    model, parts = staged_model(config), method_of(config).runtime_parts()
    net = model.build_stage(0, 1, seed=0)
    twin = model.build_stage(0, 1, seed=0)
    ours = build_optimizer(config, [net], skip=parts.skip(model))
    hooks = parts.reference(testing.method_inputs(config), model, net)
    owned = set(parts.preconditioned(config, twin, parts.skip(model)))
    named = dict(twin.named_parameters())
    rest = [name for name in named if name not in owned]
    theirs = [
        torch.optim.Muon([named[name] for name in owned], lr=LR, weight_decay=0.1, momentum=0.9),
        torch.optim.AdamW(
            [
                {"params": [named[n] for n in rest if not no_decay(n)], "weight_decay": 0.1},
                {"params": [named[n] for n in rest if no_decay(n)], "weight_decay": 0.0},
            ],
            lr=3e-3,
            eps=1e-3,
            fused=True,
        ),
    ]  # fused, as the run's AdamW
    assert owned and rest and all(named[name].dim() == 2 for name in owned)
    batch = data_source(config)
    for step in range(STEPS):
        for module, optimizers in ((net, [ours]), (twin, theirs)):
            module.zero_grad()
            model.loss(module(None, batch(step, 0)), batch(step, 0))[0].backward()
            if module is net:
                hooks.after_step_backwards(step)
                hooks.before_optimizer_update(step)
            for optimizer in optimizers:
                optimizer.step()
        # both orthogonalise in bfloat16 (8 significant bits): where a CPU's kernels (AVX-512
        # against AVX2) round the float32 inputs differently in the last bit, an element of the
        # update (at most about 1) may round the other way: LR x 2^-7 per step
        for name, value in net.named_parameters():
            torch.testing.assert_close(
                value, named[name], rtol=1e-6, atol=LR * 2**-7, msg=lambda m: f"step {step}, {name}: {m}"
            )
        # the next step starts from the same weights: bfloat16 iterations (torch's) would turn the
        # last-bit differences of one step into visible ones in the next
        with torch.no_grad():
            for name, value in net.named_parameters():
                named[name].copy_(value)
