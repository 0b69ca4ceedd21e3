"""LAMB against a float64 hand computation, zero-norm cases, weight decay, state_dict round trip;
a parameter's update whatever steps beside it, and no host reads."""

from __future__ import annotations

import math

import pytest
import torch
from host_reads import count_host_reads

from pipefisher.models.bert import BertConfig, BertStagedModel
from pipefisher.optim.first_order import no_decay
from pipefisher.optim.lamb import Lamb
from pipefisher.optim.schedule import warmup_decay


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def hand_lamb(
    p: list[float], grads: list[list[float]], lr: float, b1: float, b2: float, eps: float, wd: float
) -> list[float]:
    """LAMB on one flat parameter, element by element in Python floats (double precision)."""
    p, m, v = list(p), [0.0] * len(p), [0.0] * len(p)
    for t, g in enumerate(grads, start=1):
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        u = [(mi / (1 - b1**t)) / (math.sqrt(vi / (1 - b2**t)) + eps) + wd * pi for mi, vi, pi in zip(m, v, p)]
        p_norm, u_norm = math.sqrt(sum(x * x for x in p)), math.sqrt(sum(x * x for x in u))
        ratio = p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0
        p = [pi - lr * ratio * ui for pi, ui in zip(p, u)]
    return p


def run_lamb(p0: torch.Tensor, grads: list[torch.Tensor], **kwargs) -> torch.Tensor:
    p = torch.nn.Parameter(p0.clone())
    optimizer = Lamb([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    return p.detach()


@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_matches_hand_computation(steps: int, weight_decay: float) -> None:
    g = torch.Generator().manual_seed(steps)
    p0 = torch.randn(6, generator=g, dtype=torch.float64)
    grads = [torch.randn(6, generator=g, dtype=torch.float64) * 10 ** (-k) for k in range(steps)]
    settings = {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    got = run_lamb(p0.view(2, 3), [x.view(2, 3) for x in grads], **settings)
    lr, (b1, b2), eps = settings["lr"], settings["betas"], settings["eps"]
    expected = hand_lamb(p0.tolist(), [x.tolist() for x in grads], lr, b1, b2, eps, weight_decay)
    torch.testing.assert_close(got.flatten(), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)


def test_step_length_is_lr_times_weight_norm() -> None:
    p0 = torch.tensor([3.0, 4.0], dtype=torch.float64)
    got = run_lamb(p0, [torch.tensor([1.0, -2.0], dtype=torch.float64)], lr=0.1, eps=0.0)
    torch.testing.assert_close((got - p0).norm(), torch.tensor(0.1 * 5.0, dtype=torch.float64))
    # First step: m̂ = g, v̂ = g², so u = sign(g) and the step is −lr·‖p‖·sign(g)/‖sign(g)‖.
    torch.testing.assert_close(got, p0 - 0.5 * torch.tensor([1.0, -1.0], dtype=torch.float64) / math.sqrt(2))


def test_zero_norms_use_ratio_one() -> None:
    zero = torch.zeros(3, dtype=torch.float64)
    grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    got = run_lamb(zero, [grad], lr=0.1, eps=0.0)
    torch.testing.assert_close(got, -0.1 * torch.sign(grad))
    p0 = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64)
    assert torch.equal(run_lamb(p0, [zero], lr=0.1), p0)


def test_weight_decay_alone_shrinks_by_lr() -> None:
    p0 = torch.tensor([1.0, -2.0], dtype=torch.float64)
    got = run_lamb(p0, [torch.zeros(2, dtype=torch.float64)], lr=0.1, weight_decay=0.5)
    torch.testing.assert_close(got, 0.9 * p0)


def test_state_dict_round_trip_and_groups() -> None:
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(4, generator=g), torch.randn(3, generator=g)) for _ in range(6)]

    def make(a: torch.Tensor, b: torch.Tensor) -> Lamb:
        return Lamb([{"params": [a]}, {"params": [b], "weight_decay": 0.0}], lr=0.01, weight_decay=0.1)

    def steps(params: tuple[torch.Tensor, ...], optimizer: Lamb, chunk: list) -> None:
        for pair in chunk:
            for p, grad in zip(params, pair):
                p.grad = grad.clone()
            optimizer.step()

    straight = (torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.full((3,), 2.0)))
    steps(straight, make(*straight), grads)
    first = (torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.full((3,), 2.0)))
    optimizer = make(*first)
    steps(first, optimizer, grads[:3])
    second = tuple(torch.nn.Parameter(p.detach().clone()) for p in first)
    resumed = make(*second)
    resumed.load_state_dict(optimizer.state_dict())
    assert resumed.state[second[0]]["step"] == 3
    steps(second, resumed, grads[3:])
    for a, b in zip(straight, second):
        assert torch.equal(a, b)
    assert not torch.equal(second[0], torch.ones(4))


def test_a_parameters_update_is_the_same_whatever_steps_beside_it() -> None:
    """One group stepped together, one tensor at a time, or split over two optimizers (as ZeRO-1
    splits over ranks): the same parameters bit for bit, float32 and float64 and a transposed
    (not contiguous) one in one group; a parameter without a gradient keeps its value and gets no state."""
    g = torch.Generator().manual_seed(0)
    shapes = [
        ((5, 3), torch.float32),
        ((7,), torch.float64),
        ((4, 4), torch.float32),
        ((2,), torch.float32),
        ((3,), torch.float64),
    ]
    initial = [torch.randn(shape, generator=g, dtype=dtype) for shape, dtype in shapes]
    initial[2] = initial[2].t()
    grads = [[torch.randn(p.shape, generator=g, dtype=p.dtype) for p in initial[:-1]] for _ in range(4)]
    settings = {"lr": 0.05, "weight_decay": 0.01}

    def trained(split: list[list[int]], batch_elements: int | None) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.clone()) for p in initial]
        optimizers = [Lamb([params[i] for i in part], batch_elements=batch_elements, **settings) for part in split]
        for step in grads:
            for p, grad in zip(params, step):
                p.grad = grad.clone()
            for optimizer in optimizers:
                optimizer.step()
        assert all(params[-1] not in optimizer.state for optimizer in optimizers)
        return [p.detach() for p in params]

    together = trained([[0, 1, 2, 3, 4]], None)
    for other in (trained([[0, 1, 2, 3, 4]], 1), trained([[3, 0], [4, 2, 1]], 10**6), trained([[1, 2, 3, 4, 0]], 20)):
        assert all(torch.equal(a, b) for a, b in zip(together, other))
    assert torch.equal(together[-1], initial[-1]) and not torch.equal(together[0], initial[0])


def test_a_step_reads_no_tensor_into_python() -> None:
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.zeros(4))]
    optimizer = Lamb(params, lr=0.1, weight_decay=0.01, batch_elements=6)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape)
        with count_host_reads() as reads:
            optimizer.step()
        assert not reads, dict(reads)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"batch_elements": 0}, "batch_elements"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Lamb([torch.nn.Parameter(torch.ones(2))], **{"lr": 0.1, **kwargs})


def test_lamb_with_schedule_fits_a_small_bert_batch() -> None:
    """Lamb + warm-up/decay on decay/no-decay groups memorises one batch: loss under 30 % of its start in 40 steps."""
    config = BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=8,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertStagedModel(config, seq_len=8)
    stage = model.build_stage(0, 1, seed=0)
    named = list(stage.named_parameters())
    groups = [
        {"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.01},
        {"params": [p for n, p in named if no_decay(n)]},
    ]
    optimizer = Lamb(groups, lr=0.1)
    scheduler = warmup_decay(optimizer, warmup_steps=5, total_steps=40)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30, (4, 8), generator=g)
    batch = {
        "input_ids": ids,
        "token_type_ids": torch.zeros_like(ids),
        "attention_mask": torch.ones_like(ids),
        "mlm_labels": ids,
        "nsp_labels": torch.tensor([0, 1, 0, 1]),
    }
    losses = []
    for _ in range(40):
        loss, _ = model.loss(stage(None, batch), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]
