"""A tensor-parallel split keeps the model: shards joined are the unsplit state dict, the
reference's side-by-side shards compute the unsplit layers' outputs and report their parameters
under the unsplit names."""

import pytest
import torch

from pipefisher.config import ModelConfig
from pipefisher.core.tensor_parallel import split_of
from pipefisher.models.bert import BertStagedModel, bert_preset
from pipefisher.models.tensor_parallel import emulate_shards, join_shard_states, shard_linear, unsharded_parameters
from pipefisher.models.tiny import TinyRegression

MODELS = {
    "bert": lambda: BertStagedModel(bert_preset("bert-mini", vocab_size=50), 8),
    "transformer": lambda: TinyRegression(ModelConfig(layers=2, hidden=16, heads=4, ffn=32)),
}


def shard_state(module, plan, degree, index):
    """What process `index` of `degree` holds of `module`: its split layers' shards, the rest whole."""
    state = dict(module.state_dict())
    for name, child in module.named_modules():
        split = split_of(name, plan)
        if split is not None:
            for key in ("weight", "bias"):
                state.pop(f"{name}.{key}", None)
            state.update(
                {
                    f"{name}.{key}": value
                    for key, value in shard_linear(child, split, degree, index).state_dict().items()
                }
            )
    return state


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("degree", [2, 4])
def test_shards_join_into_the_unsplit_state_dict(kind, degree):
    model = MODELS[kind]()
    stage = model.build_stage(0, 1, seed=3)
    plan = model.tensor_parallel_plan(degree)
    shards = [shard_state(stage, plan, degree, index) for index in range(degree)]
    assert any(shards[0][key].shape != value.shape for key, value in stage.state_dict().items()), "something is split"
    joined = join_shard_states(shards, plan)
    assert joined.keys() == stage.state_dict().keys()
    assert all(torch.equal(joined[key], value) for key, value in stage.state_dict().items())


@pytest.mark.parametrize("kind", MODELS)
def test_side_by_side_shards_compute_the_unsplit_model(kind):
    model = MODELS[kind]()
    stage, emulated = (
        model.build_stage(0, 1, seed=3),
        emulate_shards(model.build_stage(0, 1, seed=3), model.tensor_parallel_plan(2), 2),
    )
    assert dict(unsharded_parameters(emulated)).keys() == dict(stage.named_parameters()).keys()
    assert all(torch.equal(tensor, stage.get_parameter(name)) for name, tensor in unsharded_parameters(emulated))
    batch = (
        {
            "input_ids": torch.randint(0, 50, (2, 8)),
            "token_type_ids": torch.zeros(2, 8, dtype=torch.long),
            "attention_mask": torch.ones(2, 8),
        }
        if kind == "bert"
        else {"inputs": torch.randn(2, 8, 16)}
    )
    stage.eval(), emulated.eval()
    for ours, theirs in zip(emulated(None, batch), stage(None, batch)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", MODELS)
def test_a_block_sums_over_the_shards_twice_forward_and_twice_backward(kind):
    """Megatron's count: the row-split outputs (attention, MLP) in the forward, the column-split
    inputs in the backward, where query, key and value share one sum of their input's gradient."""
    from torch.distributed.device_mesh import DeviceMesh

    from pipefisher.models.tensor_parallel import parallelize
    from pipefisher.runtime.training.launch import world_of_one

    model = MODELS[kind]()
    calls = {"forward": 0, "backward": 0}
    phase = {"now": "forward"}

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        calls[phase["now"]] += 1
        return tensor

    with world_of_one("gloo", torch.device("cpu")):
        stage = model.build_stage(0, 1, seed=3)
        parallelize(stage, model.tensor_parallel_plan(1), DeviceMesh("cpu", [0]), counting)
        batch = (
            {
                "input_ids": torch.randint(0, 50, (2, 8)),
                "token_type_ids": torch.zeros(2, 8, dtype=torch.long),
                "attention_mask": torch.ones(2, 8),
            }
            if kind == "bert"
            else {"inputs": torch.randn(2, 8, 16)}
        )
        output = stage(None, batch)
        blocks = 4 if kind == "bert" else 2
        assert calls == {"forward": 2 * blocks, "backward": 0}
        phase["now"] = "backward"
        sum(part.sum() for part in (output if isinstance(output, tuple) else (output,))).backward()
        assert calls == {"forward": 2 * blocks, "backward": 2 * blocks}
