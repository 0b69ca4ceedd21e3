"""Initialisation depends on (seed, global name) alone: every split builds the unsplit model's parameters."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipefisher.config import ModelConfig
from pipefisher.models import Batch, StagedModel
from pipefisher.models.bert import BertStagedModel, bert_preset
from pipefisher.models.tiny import TinyRegression, pytorch_default_init

SEQ = 8
MODELS = ("transformer", "mlp", "bert")


def make_model(kind: str) -> StagedModel:
    if kind == "bert":
        return BertStagedModel(bert_preset("bert-4x128", vocab_size=50), SEQ)
    return TinyRegression(ModelConfig(kind=kind, layers=4, seq_len=SEQ))


def make_batch(model: StagedModel, size: int = 3) -> Batch:
    """A micro-batch of the model's data; BERT's sequence b ends in b pads."""
    g = torch.Generator().manual_seed(0)
    if isinstance(model, TinyRegression):
        return {"inputs": torch.randn(size, SEQ, model.config.input_dim, generator=g)}
    mask = (torch.arange(SEQ) < SEQ - torch.arange(size)[:, None]).long()
    return {
        "input_ids": torch.randint(0, model.config.vocab_size, (size, SEQ), generator=g),
        "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long().expand(size, SEQ).clone(),
        "attention_mask": mask,
    }


def split_parameters(model: StagedModel, num_stages: int, seed: int) -> dict[str, Tensor]:
    """{name: parameter} over all stages; a name held by two stages fails, except the tied copy on the
    last stage, which must equal the first stage's and is left out (the one-stage model holds one)."""
    stages = [model.build_stage(i, num_stages, seed) for i in range(num_stages)]
    params: dict[str, Tensor] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert name not in params, f"{name} is on two stages"
            params[name] = p
    tied = dict(model.tied_parameters())
    if tied and num_stages > 1:
        assert torch.equal(params.pop(tied["last"]), params[tied["first"]])
    return params


@pytest.mark.parametrize("num_stages", [1, 2, 4])
@pytest.mark.parametrize("kind", MODELS)
def test_union_of_stages_is_the_unsplit_model(kind: str, num_stages: int) -> None:
    model = make_model(kind)
    unsplit = split_parameters(model, 1, seed=3)
    split = split_parameters(model, num_stages, seed=3)
    assert split.keys() == unsplit.keys()
    for name, p in unsplit.items():
        assert torch.equal(split[name], p), name


def test_tiny_block_names_are_global() -> None:
    model = make_model("transformer")
    first, last = model.build_stage(0, 2, seed=0), model.build_stage(1, 2, seed=0)
    assert (list(first.blocks), list(last.blocks)) == (["0", "1"], ["2", "3"])
    linears = [name for name, module in first.named_modules() if isinstance(module, nn.Linear)]
    assert linears[:2] == ["embed", "blocks.0.attention.query"]
    assert "blocks.3.output.weight" in dict(last.named_parameters())


@pytest.mark.parametrize("kind", MODELS)
def test_seed_redraws_every_random_parameter(kind: str) -> None:
    model = make_model(kind)
    a, b = split_parameters(model, 2, seed=0), split_parameters(model, 2, seed=1)
    random = {name for name, p in a.items() if p.unique().numel() > 1}
    assert random and {name for name in a if not torch.equal(a[name], b[name])} == random


@pytest.mark.parametrize("kind", MODELS)
def test_build_stage_neither_touches_nor_reads_the_global_rng(kind: str) -> None:
    model = make_model(kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        state = torch.random.get_rng_state()
        first = split_parameters(model, 2, seed=5)
        assert torch.equal(torch.random.get_rng_state(), state)
        torch.manual_seed(12)
        second = split_parameters(model, 2, seed=5)
    assert all(torch.equal(p, second[name]) for name, p in first.items())


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("kind", MODELS)
def test_chained_split_forward_equals_unsplit(kind: str, num_stages: int) -> None:
    model = make_model(kind)
    batch = make_batch(model)
    x = None
    for i in range(num_stages):
        x = model.build_stage(i, num_stages, seed=2).eval()(x, batch)
    expected = model.build_stage(0, 1, seed=2).eval()(None, batch)
    split, unsplit = (x, expected) if isinstance(x, tuple) else ((x,), (expected,))
    assert len(split) == len(unsplit) and all(torch.equal(s, u) for s, u in zip(split, unsplit))


@pytest.mark.parametrize(
    "module", [nn.Linear(7, 5), nn.Linear(300, 2), nn.LayerNorm(6)], ids=["linear", "wide", "norm"]
)
def test_pytorch_default_init_draws_what_torch_draws(module: nn.Module) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        module.reset_parameters()
    expected = {name: p.clone() for name, p in module.named_parameters()}
    with torch.no_grad():
        pytorch_default_init(module, torch.Generator().manual_seed(4))
    for name, p in module.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_unknown_module_type_is_refused() -> None:
    with pytest.raises(TypeError, match="Embedding"), torch.no_grad():
        pytorch_default_init(nn.Embedding(3, 2), torch.Generator())
