"""`model.recompute`: a checkpointed stage computes the same gradients bit for bit (dropout
included, whole or split backward), K-FAC captures each layer once per micro-batch, a pipelined
run with recomputation equals the reference, and the refused combinations say why in one line."""

import dataclasses

import pytest
import torch

from _workers import assert_equal_to_reference
from builders import tiny_model
from pipefisher.config import ConfigError, ModelConfig, config_from_dict
from pipefisher.methods.kfac.capture import capture
from pipefisher.methods.kfac.layer import select_layers
from pipefisher.models.bert import BertStagedModel, bert_preset
from pipefisher.models.tensor_parallel import parallelize
from pipefisher.runtime.primitives.recompute import recompute_modules
from pipefisher.runtime.pipeline.split_backward import SplitBackward
from pipefisher.runtime.training.assembly import staged_model
from pipefisher.runtime.training.launch import run_group
from sweeps import pipeline

BATCH, SEQ = 2, 8


def _mlp_model(**changes) -> dict:
    """The tiny model's section as an MLP: without the attention heads and feed-forward width it has none of."""
    model = tiny_model(kind="mlp", **changes)
    del model["heads"], model["ffn"]
    return model


def _tiny(kind: str = "transformer"):
    model = _mlp_model(seq_len=SEQ) if kind == "mlp" else tiny_model(kind=kind, seq_len=SEQ)
    return staged_model(config_from_dict({"model": model}))


def _bert():
    return BertStagedModel(dataclasses.replace(bert_preset("bert-4x128"), vocab_size=300), SEQ)  # dropout 0.1


def _gpt2():
    pytest.importorskip("transformers")
    from pipefisher.runtime.training.hf_skeleton import hf_staged

    return hf_staged(ModelConfig(kind="hf", hf_config="gpt2-tiny", seq_len=SEQ))  # dropout 0.1


MODELS = {"transformer": _tiny, "mlp": lambda: _tiny("mlp"), "bert": _bert, "gpt2": _gpt2}
CASES = [
    ("transformer", "blocks", 2),
    ("transformer", "selective", 2),
    ("mlp", "blocks", 2),
    ("bert", "blocks", 2),
    ("bert", "selective", 2),
    ("gpt2", "blocks", 2),
]


def _gradients(stage, width: int, split: bool) -> dict[str, torch.Tensor]:
    """Input and parameter gradients of stage 1 of 2 (the last) on a fixed input, dropout seeded."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, width, generator=generator).requires_grad_()
    batch = {"attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
    torch.manual_seed(2)
    outputs = stage(x, batch)
    loss = sum((output.float() ** 2).mean() for output in (outputs if isinstance(outputs, tuple) else (outputs,)))
    if split:
        backward = SplitBackward(stage)
        backward.input_gradient(0, loss, None, x)
        backward.weight_gradient(0)
    else:
        loss.backward()
    return {"input": x.grad, **{name: parameter.grad for name, parameter in stage.named_parameters()}}


@pytest.mark.parametrize("model, mode, wrapped", CASES, ids=[f"{m}-{mode}" for m, mode, _ in CASES])
def test_a_recomputed_stage_has_the_same_gradients_bit_for_bit(model, mode, wrapped):
    staged = MODELS[model]()
    width = staged.activation_shape(0, 2, 1)[-1] if model not in ("transformer", "mlp") else staged.config.hidden
    plain = _gradients(staged.build_stage(1, 2, 0), width, split=False)
    for split in (False, True):
        stage = staged.build_stage(1, 2, 0)
        assert len(recompute_modules(stage, staged.recompute_plan(mode))) == wrapped
        assert [name for name, _ in stage.named_parameters()] == list(plain)[1:], "names stay"
        got = _gradients(stage, width, split)
        for name, gradient in plain.items():
            assert torch.equal(got[name], gradient), f"{name} (split backward: {split})"


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_kfac_captures_each_layer_once_per_micro_batch_under_recomputation(mode):
    """The worst case: forward and backward both inside the capture, so the recomputed forward
    runs while the hooks are registered; and the split backward, which reaches outputs twice."""
    staged = _tiny()
    for split in (False, True):
        stage = staged.build_stage(1, 2, 0)
        recompute_modules(stage, staged.recompute_plan(mode))
        layers = select_layers(stage)
        for micro_batch in range(2):
            with capture(layers, micro_batch):
                _gradients(stage, staged.config.hidden, split)
        for name, state in layers.items():
            for factor in ("A", "B"):
                counts = [len(state.captures[factor][micro_batch]) for micro_batch in range(2)]
                assert counts == [1, 1], f"{name} {factor} (split backward: {split}): {counts}"


def _shard_all_reduces(rank: int, world: int) -> dict[tuple[str, str], tuple[list, list]]:
    """Shard `rank` of `world` of stage 1 of the regression transformer and of BERT (a row split's
    bias on shard 0 only), under each recompute mode: the shapes of the all-reduces over the
    shards (real ones) its forward and its backward issue, in order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor",))
    issued: list[tuple[int, ...]] = []

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        issued.append(tuple(tensor.shape))
        dist.all_reduce(tensor, group=mesh.get_group())
        return tensor

    found = {}
    for model in ("transformer", "bert"):
        staged = MODELS[model]()
        width = staged.config.hidden if model == "transformer" else staged.activation_shape(0, 2, 1)[-1]
        for mode in ("none", "selective", "blocks"):
            stage = staged.build_stage(1, 2, 0)
            parallelize(stage, staged.tensor_parallel_plan(world), mesh, reduce)
            recompute_modules(stage, staged.recompute_plan(mode))
            issued.clear()
            torch.manual_seed(2)
            x = torch.randn(BATCH, SEQ, width, generator=torch.Generator().manual_seed(1), requires_grad=True)
            outputs = stage(x, {"attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)})
            forward = list(issued)
            sum(
                (output.float() ** 2).mean() for output in (outputs if isinstance(outputs, tuple) else (outputs,))
            ).backward()
            found[(model, mode)] = (forward, issued[len(forward) :])
    return found


@pytest.mark.dist
def test_a_recomputed_tensor_parallel_block_all_reduces_again_in_its_backward():
    """Two real shards: each issues the same all-reduces in the same order (what NCCL's rule needs
    of the recomputed forwards inside a backward); `blocks` adds the recomputed forwards' row-split
    all-reduces to the backward (PyTorch's checkpoint stops recomputing after the last tensor the
    backward needs, so not always all of them), `selective` none (the attention core holds no split layer)."""
    shards = run_group(_shard_all_reduces, 2, timeout=30, deadline=120)
    assert shards[0] == shards[1]
    for model in ("transformer", "bert"):
        forward, backward = shards[0][(model, "none")]
        assert len(forward) == len(backward) == 4, model  # 2 blocks x (attention, MLP)
        assert shards[0][(model, "selective")] == (forward, backward), model
        recomputed_forward, recomputed_backward = shards[0][(model, "blocks")]
        assert recomputed_forward == forward and len(recomputed_backward) > len(backward), model


def _kfac_config(schedule: str, mode: str):
    return config_from_dict(
        {
            "model": tiny_model(recompute=mode),
            "data": {"micro_batch_size": 2},
            "pipeline": pipeline(schedule),
            "optimizer": {"name": "kfac", "lr": 0.01, "eps": 1e-3},
            "kfac": {"refresh_steps": 2},
            "run": {"steps": 2, "timeout": 30, "master_port": 0, "in_order": True},
        }
    )


@pytest.mark.dist
@pytest.mark.parametrize(
    "schedule, mode", [("1f1b", "blocks"), pytest.param("zb-h1", "selective", marks=pytest.mark.slow)]
)
def test_a_pipelined_kfac_run_with_recomputation_equals_the_reference(schedule, mode):
    """2 gloo ranks recomputing against the single-process reference (which does not): K-FAC's factors
    would differ with a layer captured twice, and its SGD steps what it does not precondition."""
    assert_equal_to_reference(_kfac_config(schedule, mode), parameter_atol=1e-7)


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"model": tiny_model(recompute="blocks"), "pipeline": {"schedule": "zbv"}},
            "model.recompute: blocks under zbv, whose split backward recomputes each block again",
        ),
        ({"model": _mlp_model(recompute="selective")}, "model.recompute: model.kind mlp has no attention"),
    ],
)
def test_recompute_refuses_what_it_cannot_serve_in_one_line(data, message):
    with pytest.raises(ConfigError, match=message) as raised:
        staged_model(config_from_dict(data))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_recompute_composes_with_tensor_parallelism(mode):
    """Accepted: a recomputed block all-reduces again inside its backward, in the issue order
    the replay counts (`tests/test_comm_plan.py`); the run equals the reference
    (`tests/runtime/test_tensor_parallel.py`)."""
    config = config_from_dict({"model": tiny_model(heads=2, recompute=mode), "pipeline": {"tensor_parallel": 2}})
    assert staged_model(config).recompute_plan(mode)


def test_hugging_face_selective_is_refused_naming_the_model_and_blocks():
    with pytest.raises(
        ValueError, match="GPT2LMHeadModel computes inside its attention module; use model.recompute blocks"
    ):
        _gpt2().recompute_plan("selective")


def test_recomputed_blocks_compile_into_one_graph_without_breaks():
    """`run.compile` composes: dynamo traces the checkpoint as one graph per block (AOT autograd
    here, inductor in a run; its code generation takes ~45 s on a small CPU) to the same gradients."""
    from torch._dynamo.utils import counters

    staged = _tiny()
    plain = _gradients(staged.build_stage(1, 2, 0), staged.config.hidden, split=False)
    stage = staged.build_stage(1, 2, 0)
    recompute_modules(stage, staged.recompute_plan("blocks"), announce=False)
    counters.clear()
    for block in stage.blocks.values():
        block.compile(backend="aot_eager")
    got = _gradients(stage, staged.config.hidden, split=False)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    for name, gradient in plain.items():
        torch.testing.assert_close(got[name], gradient, rtol=1e-5, atol=1e-7, msg=lambda text: f"{name}: {text}")
