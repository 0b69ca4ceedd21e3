"""Hugging Face models cut into stages: every split computes what the unsplit `transformers` model
computes, parameters keep their Hugging Face names, and bad models are refused by name."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipefisher.models.hf import HfStagedModel, load_hf_config  # noqa: E402

VOCAB, SEQ = 300, 16
NO_DROPOUT = {
    "gpt2-tiny": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "bert-tiny": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "llama-tiny": {},
}
CLASSES = {"gpt2-tiny": "GPT2LMHeadModel", "bert-tiny": "BertForPreTraining", "llama-tiny": "LlamaForCausalLM"}
#: decoders laid out like Llama, as configs of the same size (Mistral without its sliding window)
LIKE_LLAMA = {
    "MistralForCausalLM": {"model_type": "mistral", "sliding_window": None},
    "Qwen2ForCausalLM": {"model_type": "qwen2"},
}


def staged(name: str) -> HfStagedModel:
    if name in LIKE_LLAMA:
        values = {**load_hf_config("llama-tiny").to_dict(), **LIKE_LLAMA[name], "vocab_size": VOCAB}
        return HfStagedModel(name, transformers.AutoConfig.for_model(values.pop("model_type"), **values), SEQ)
    return HfStagedModel(CLASSES[name], load_hf_config(name, vocab_size=VOCAB, **NO_DROPOUT[name]), SEQ)


def batch_for(model: HfStagedModel, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=generator)
    if model.layout.data == "causal":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 10:] = 0  # padding: the mask must reach every stage
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    return {
        "input_ids": ids,
        "token_type_ids": torch.zeros_like(ids),
        "attention_mask": attention_mask,
        "mlm_labels": labels,
        "nsp_labels": torch.tensor([0, 1, 0]),
    }


def chained(stages, model, batch):
    x = None
    for stage in stages:
        x = stage(x, batch)
    return model.loss(x, batch)


@pytest.mark.filterwarnings("error::FutureWarning")  # the stages call transformers' current API, not a deprecated one
@pytest.mark.parametrize("name", [*CLASSES, *LIKE_LLAMA])
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_every_split_computes_the_unsplit_models_loss_and_gradients(name, num_stages):
    model = staged(name)
    batch = batch_for(model)
    unsplit = model.unsplit(seed=3)
    expected, _ = model.unsplit_loss(unsplit, batch)
    expected.backward()
    stages = [model.build_stage(index, num_stages, seed=3) for index in range(num_stages)]
    loss, _ = chained(stages, model, batch)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    reference = dict(unsplit.named_parameters(remove_duplicate=False))
    gradients: dict[str, torch.Tensor] = {}
    for stage in stages:
        for key, parameter in stage.named_parameters():
            torch.testing.assert_close(parameter, reference[key], rtol=0, atol=0)
            source = model.tied.get(key, key)  # a copy of a tied weight holds its share of the gradient
            gradients[source] = gradients.get(source, 0) + parameter.grad
    for key, gradient in gradients.items():
        torch.testing.assert_close(gradient, reference[key].grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(CLASSES))
def test_the_stages_state_dicts_load_into_the_unsplit_model_and_back(name):
    model = staged(name)
    stages = [model.build_stage(index, 2, seed=5) for index in range(2)]
    union = {key: value for stage in stages for key, value in stage.state_dict().items()}
    target = model.unsplit(seed=6)
    assert set(union) == set(target.state_dict()), "stage names are the Hugging Face names"
    target.load_state_dict(union)
    for stage in stages:
        for key, value in stage.state_dict().items():
            assert torch.equal(target.state_dict()[key], value)


def test_tied_weights_the_first_and_last_stage_hold_as_copies():
    gpt2 = staged("gpt2-tiny")
    assert gpt2.tied_parameters() == [("first", "transformer.wte.weight"), ("last", "lm_head.weight")]
    assert gpt2.first_order_linears() == ("lm_head",)
    one = gpt2.build_stage(0, 1, seed=1)
    assert one.lm_head.weight is one.transformer.wte.weight, "one stage holds one Parameter"
    bert = staged("bert-tiny")
    last = bert.build_stage(1, 2, seed=1)
    assert last.cls.predictions.decoder.bias is last.cls.predictions.bias, "tied within a stage: one Parameter"
    assert staged("llama-tiny").tied_parameters() == []


def test_hf_weights_load_a_save_pretrained_checkpoint(tmp_path):
    source = staged("gpt2-tiny")
    unsplit = source.unsplit(seed=11)
    unsplit.save_pretrained(tmp_path)
    weights = str(tmp_path / "model.safetensors")
    loaded = HfStagedModel("GPT2LMHeadModel", source.config, SEQ, weights)
    last = loaded.build_stage(1, 2, seed=0)
    torch.testing.assert_close(last.lm_head.weight, unsplit.transformer.wte.weight, rtol=0, atol=0)
    torch.testing.assert_close(last.transformer.ln_f.weight, unsplit.transformer.ln_f.weight, rtol=0, atol=0)


def test_a_weight_tied_across_other_stages_than_first_and_last_is_refused():
    model = staged("gpt2-tiny")
    model.check_split(2)
    model.tied["transformer.h.3.mlp.c_fc.weight"] = "transformer.h.0.mlp.c_fc.weight"
    model.check_split(1)  # one stage holds both: one Parameter
    with pytest.raises(
        ValueError,
        match="ties transformer.h.3.mlp.c_fc.weight to transformer.h.0.mlp.c_fc.weight, which 2 stages hold apart",
    ):
        model.check_split(2)


def test_stage_ends_are_the_last_block_of_each_stage_but_the_last():
    assert staged("llama-tiny").stage_ends(2) == ["model.layers.1"]
    assert staged("gpt2-tiny").stage_ends(4) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


@pytest.mark.parametrize(
    "class_name, config, message",
    [
        (
            "GPT2Model",
            "gpt2-tiny",
            "GPT2Model has no block list pipefisher recognises (transformer.h, bert.encoder.layer, model.layers)",
        ),
        (
            "CohereForCausalLM",
            {
                "model_type": "cohere",
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "intermediate_size": 64,
                "vocab_size": 100,
            },
            "CohereForCausalLM (model_type cohere) has the block list model.layers, but its forward is not one pipefisher follows",
        ),
        ("NoSuchModel", "gpt2-tiny", "hf_class: 'NoSuchModel' is not a model class of transformers"),
        (
            "MistralForCausalLM",
            {
                "model_type": "mistral",
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "intermediate_size": 64,
                "vocab_size": 100,
            },
            "config field sliding_window = 4096 is not supported",
        ),
    ],
)
def test_models_the_splitter_cannot_cut_are_refused_by_name(class_name, config, message, tmp_path):
    if isinstance(config, dict):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        config = str(path)
    with pytest.raises(ValueError) as error:
        HfStagedModel(class_name, load_hf_config(config), SEQ)
    assert message in str(error.value)


def test_a_config_that_is_not_a_file_or_a_shipped_name_is_refused():
    with pytest.raises(ValueError, match="hf_config: 'gpt9' is neither a file nor one of gpt2-tiny"):
        load_hf_config("gpt9")
