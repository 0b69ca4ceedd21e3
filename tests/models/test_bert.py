"""BERT stages: shapes, split equivalence, weight tying, padding, config parsing, sizes, maths."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math

import pytest
import torch
from torch import nn

from pipefisher.methods.kfac.layer import select_layers
from pipefisher.models.bert import BERT_PRESETS, BertConfig, BertStagedModel, bert_preset
from pipefisher.optim.first_order import no_decay

SMALL = BertConfig(
    vocab_size=40,
    hidden_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
SEQ = 8


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make_batch(batch: int = 3, seq: int = SEQ, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ids; sequence b has b trailing pads; about a third of the real tokens carry labels."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for b in range(batch):
        mask[b, seq - b :] = 0
    labels = torch.randint(0, SMALL.vocab_size, (batch, seq), generator=g)
    labelled = (torch.rand(batch, seq, generator=g) < 0.35) & mask.bool()
    labelled[:, 1] = True
    return {
        "input_ids": torch.randint(0, SMALL.vocab_size, (batch, seq), generator=g),
        "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(batch, seq).clone(),
        "attention_mask": mask,
        "mlm_labels": torch.where(labelled, labels, torch.full_like(labels, -100)),
        "nsp_labels": torch.randint(0, 2, (batch,), generator=g),
    }


def run(stages: list[nn.Module], batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x = None
    for stage in stages:
        x = stage(x, batch)
    return x


def test_shapes_and_activation_shape() -> None:
    model = BertStagedModel(SMALL, SEQ)
    stages = [model.build_stage(i, 2, seed=0) for i in range(2)]
    batch = make_batch()
    hidden = stages[0](None, batch)
    assert hidden.shape == model.activation_shape(0, 2, 3) == (3, SEQ, SMALL.hidden_size)
    mlm, nsp = stages[1](hidden, batch)
    assert mlm.shape == (3, SEQ, SMALL.vocab_size) and nsp.shape == (3, 2)
    assert list(stages[1].encoder.layer) == ["2", "3"]
    with pytest.raises(ValueError, match="stage"):
        model.activation_shape(1, 2, 3)
    with pytest.raises(ValueError, match="num_stages"):
        model.build_stage(0, 3, seed=0)
    with pytest.raises(ValueError, match="^x: "):
        stages[1](None, batch)
    with pytest.raises(ValueError, match="seq_len"):
        BertStagedModel(SMALL, SMALL.max_position_embeddings + 1)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_split_matches_single_stage(num_stages: int) -> None:
    model = BertStagedModel(SMALL, SEQ)
    full = model.build_stage(0, 1, seed=3).double()
    stages = [model.build_stage(i, num_stages, seed=3).double() for i in range(num_stages)]
    batch = make_batch()
    loss_full, parts_full = model.loss(run([full], batch), batch)
    loss_split, parts_split = model.loss(run(stages, batch), batch)
    loss_full.backward()
    loss_split.backward()
    torch.testing.assert_close(loss_split, loss_full, rtol=0, atol=1e-10)
    torch.testing.assert_close(parts_split, parts_full, rtol=0, atol=1e-10)

    (first, first_name), (last, last_name) = model.tied_parameters()
    assert (first, last) == ("first", "last")
    grads = {name: p.grad for stage in stages for name, p in stage.named_parameters() if name != last_name}
    grads[first_name] = grads[first_name] + stages[-1].get_parameter(last_name).grad
    expected = {name: p.grad for name, p in full.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-8, atol=1e-10, msg=name)
    assert stages[-1].get_parameter(last_name).grad.abs().sum() > 0
    assert stages[0].get_parameter(first_name).grad.abs().sum() > 0


def test_tied_copies_and_seeding() -> None:
    model = BertStagedModel(BertConfig(**{**dataclasses.asdict(SMALL), "num_hidden_layers": 2}), SEQ)
    (_, first_name), (_, last_name) = model.tied_parameters()
    rng = torch.random.get_rng_state()
    first, last = model.build_stage(0, 2, seed=5), model.build_stage(1, 2, seed=5)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert torch.equal(first.get_parameter(first_name), last.get_parameter(last_name))
    assert first.get_parameter(first_name).std().item() == pytest.approx(SMALL.initializer_range, rel=0.1)
    assert not torch.equal(first.get_parameter(first_name), model.build_stage(0, 2, seed=6).get_parameter(first_name))
    again = model.build_stage(1, 2, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(last.parameters(), again.parameters()))
    single = model.build_stage(0, 1, seed=5)
    assert single.get_parameter(last_name) is single.get_parameter(first_name)
    assert torch.equal(single.get_parameter(first_name), first.get_parameter(first_name))
    assert len(list(single.parameters())) == len(single.state_dict()) - 1

    for name, p in single.named_parameters():
        if name.endswith("bias"):
            assert not p.any(), name
        elif "LayerNorm" in name:
            assert torch.equal(p, torch.ones_like(p)), name


def test_padding_does_not_change_real_positions() -> None:
    model = BertStagedModel(SMALL, SEQ)
    stages = [model.build_stage(i, 2, seed=1).eval() for i in range(2)]
    batch = make_batch(batch=1)
    real = 5
    batch["attention_mask"][0, real:] = 0
    mlm, nsp = run(stages, batch)
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, real:] = (changed["input_ids"][0, real:] + 7) % SMALL.vocab_size
    changed["token_type_ids"][0, real:] = 1 - changed["token_type_ids"][0, real:]
    mlm_changed, nsp_changed = run(stages, changed)
    truncated = {k: (v[:, :real] if v.dim() == 2 else v) for k, v in batch.items()}
    mlm_short, nsp_short = run(stages, truncated)
    torch.testing.assert_close(mlm_changed[:, :real], mlm[:, :real])
    torch.testing.assert_close(mlm_short, mlm[:, :real])
    torch.testing.assert_close(nsp_changed, nsp)
    torch.testing.assert_close(nsp_short, nsp)
    assert not torch.allclose(mlm_changed[:, real:], mlm[:, real:])


def reference_forward(params: dict[str, torch.Tensor], config: BertConfig, batch: dict[str, torch.Tensor]):
    """BERT written out with plain tensor ops, from HF's description of BertForPreTraining."""

    def linear(x, name):
        return x @ params[f"{name}.weight"].T + params[f"{name}.bias"]

    def norm(x, name):
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + config.layer_norm_eps) * params[f"{name}.weight"] + params[f"{name}.bias"]

    gelu = lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    ids = batch["input_ids"]
    seq, heads = ids.shape[1], config.num_attention_heads
    d = config.hidden_size // heads
    x = (
        params["embeddings.word_embeddings.weight"][ids]
        + params["embeddings.position_embeddings.weight"][:seq]
        + params["embeddings.token_type_embeddings.weight"][batch["token_type_ids"]]
    )
    x = norm(x, "embeddings.LayerNorm")
    pad = (1 - batch["attention_mask"].double())[:, None, None, :] * -1e30
    for i in range(config.num_hidden_layers):
        block = f"encoder.layer.{i}"
        q, k, v = (
            linear(x, f"{block}.attention.self.{n}").unflatten(-1, (heads, d)).transpose(1, 2)
            for n in ("query", "key", "value")
        )
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + pad, dim=-1)
        context = (weights @ v).transpose(1, 2).flatten(2)
        x = norm(x + linear(context, f"{block}.attention.output.dense"), f"{block}.attention.output.LayerNorm")
        x = norm(
            x + linear(gelu(linear(x, f"{block}.intermediate.dense")), f"{block}.output.dense"),
            f"{block}.output.LayerNorm",
        )
    h = norm(gelu(linear(x, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
    mlm = h @ params["embeddings.word_embeddings.weight"].T + params["cls.predictions.decoder.bias"]
    nsp = linear(torch.tanh(linear(x[:, 0], "pooler.dense")), "cls.seq_relationship")
    return mlm, nsp


def test_matches_written_out_reference_and_loss() -> None:
    model = BertStagedModel(SMALL, SEQ)
    full = model.build_stage(0, 1, seed=2).double()
    batch = make_batch()
    mlm, nsp = full(None, batch)
    ref_mlm, ref_nsp = reference_forward(full.state_dict(), SMALL, batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(mlm[real], ref_mlm[real])
    torch.testing.assert_close(nsp, ref_nsp)

    total, parts = model.loss((mlm, nsp), batch)
    labelled = batch["mlm_labels"] != -100
    log_probs = torch.log_softmax(ref_mlm, -1)[labelled]
    expected_mlm = -log_probs.gather(1, batch["mlm_labels"][labelled][:, None]).mean()
    expected_nsp = -torch.log_softmax(ref_nsp, -1).gather(1, batch["nsp_labels"][:, None]).mean()
    torch.testing.assert_close(parts["mlm"], expected_mlm)
    torch.testing.assert_close(parts["nsp"], expected_nsp)
    torch.testing.assert_close(total, expected_mlm + expected_nsp)

    batch["mlm_labels"].fill_(-100)
    total, parts = model.loss((mlm, nsp), batch)
    assert parts["mlm"].item() == 0.0 and torch.isfinite(total)


def test_dropout_only_in_training() -> None:
    config = dataclasses.replace(SMALL, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    stage = BertStagedModel(config, SEQ).build_stage(0, 1, seed=0)
    batch = make_batch()
    assert not torch.equal(stage(None, batch)[0], stage(None, batch)[0])
    stage.eval()
    assert torch.equal(stage(None, batch)[0], stage(None, batch)[0])


def test_first_order_linears_leaves_only_the_decoder_first_order() -> None:
    model = BertStagedModel(SMALL, SEQ)
    stage = model.build_stage(0, 1, seed=0)
    linears = {name for name, m in stage.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 6 * SMALL.num_hidden_layers + 4
    skipped = {name for name in linears if any(fnmatch.fnmatchcase(name, p) for p in model.first_order_linears())}
    assert skipped == {"cls.predictions.decoder"}
    assert set(select_layers(stage, model.first_order_linears())) == linears - skipped
    assert "encoder.layer.3.attention.self.query" in linears and "pooler.dense" in linears


def test_no_decay() -> None:
    assert no_decay("encoder.layer.0.attention.self.query.bias")
    assert no_decay("embeddings.LayerNorm.weight") and no_decay("cls.predictions.transform.LayerNorm.weight")
    assert not no_decay("encoder.layer.0.output.dense.weight")
    assert not no_decay("embeddings.word_embeddings.weight")


HF_BASE_UNCASED = {
    "architectures": ["BertForMaskedLM"],
    "attention_probs_dropout_prob": 0.1,
    "gradient_checkpointing": False,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
    "transformers_version": "4.6.0.dev0",
    "type_vocab_size": 2,
    "use_cache": True,
    "vocab_size": 30522,
}


def test_from_dict_and_json(tmp_path) -> None:
    assert BertConfig.from_dict(HF_BASE_UNCASED) == BERT_PRESETS["bert-base"]
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({**HF_BASE_UNCASED, "hidden_size": 256, "num_attention_heads": 4, "hidden_dropout_prob": 0})
    )
    config = BertConfig.from_json(path)
    assert (config.hidden_size, config.num_attention_heads, config.hidden_dropout_prob) == (256, 4, 0.0)
    assert bert_preset("bert-mini", vocab_size=1000).vocab_size == 1000
    assert bert_preset("bert-mini").hidden_size == 256
    with pytest.raises(ValueError, match="preset"):
        bert_preset("bert-huge")


def test_the_run_file_offers_exactly_the_presets_there_are():
    import typing

    from pipefisher.models.settings import BertPreset

    assert set(typing.get_args(BertPreset)) == set(BERT_PRESETS)


@pytest.mark.parametrize(
    "key, value",
    [
        ("hidden_size", "768"),
        ("num_hidden_layers", 0),
        ("vocab_size", True),
        ("num_attention_heads", 5),
        ("hidden_act", "swishy"),
        ("hidden_act", 3),
        ("hidden_dropout_prob", 1.0),
        ("attention_probs_dropout_prob", -0.1),
        ("initializer_range", 0.0),
        ("layer_norm_eps", "1e-12"),
        ("type_vocab_size", 2.0),
        ("position_embedding_type", "relative_key"),
    ],
)
def test_from_dict_rejects_bad_values(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key):
        BertConfig.from_dict({**HF_BASE_UNCASED, key: value})


# Parameter counts of HF's BertModel (embeddings + encoder + pooler) for bert-base/large-uncased and
# Google's BERT-Mini/Tiny; published sizes (with heads): 110 M, 340 M (Devlin et al.), 11.3 M, 4.4 M (Turc et al.).
@pytest.mark.parametrize(
    "name, body, paper",
    [
        ("bert-base", 109_482_240, 110e6),
        ("bert-large", 335_141_888, 340e6),
        ("bert-mini", 11_170_560, 11.3e6),
        ("bert-tiny", 4_385_920, 4.4e6),
    ],
)
def test_preset_parameter_counts(name: str, body: int, paper: float) -> None:
    config = BERT_PRESETS[name]
    with torch.device("meta"):
        stage = BertStagedModel(config, 128).build_stage(0, 1, seed=0)
    counts = {n: p.numel() for n, p in stage.named_parameters()}
    assert sum(v for n, v in counts.items() if not n.startswith("cls.")) == body
    assert abs(sum(counts.values()) - paper) / paper < 0.03
