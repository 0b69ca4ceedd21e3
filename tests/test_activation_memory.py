"""The activation model against what autograd saves on pipefisher's real stages, against the live
bytes of several micro-batches in flight under bf16 (the step cache's weight copies), its per-rank
peaks over hand-counted schedules, and the whole per-rank model against live tensor bytes of a run."""

import dataclasses
from pathlib import Path

import pytest
import torch

from pipefisher.config import load_config
from pipefisher.planning.memory.activations import (
    ModelShape,
    activation_peaks,
    block_linear_elements,
    micro_batch_bytes,
    step_cast_bytes,
)
from pipefisher.planning.memory.backward import backward_transient_bytes
from pipefisher.planning.planner.candidates import Layout
from pipefisher.planning.planner.layout_memory import activation_per_rank
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.runtime.gradient_path.precision import Precision
from pipefisher.runtime.training.memory_probe import LiveTensorBytes, saved_bytes
from pipefisher.schedules import get_schedule

B, S, VOCAB = 3, 20, 300
BERT_BASE = Path(__file__).resolve().parents[1] / "schedules" / "bert-base-1f1b-4x4.yaml"


def test_one_f_one_b_holds_as_many_micro_batches_as_stages_ahead():
    schedule = get_schedule("1f1b", 2, 4)
    assert activation_peaks(schedule, [10, 100], [0, 0]) == [20, 100]
    assert activation_peaks(get_schedule("gpipe", 2, 4), [10, 100], [0, 0]) == [40, 400]
    # a backward's transient counts on top of what is held when it starts
    assert activation_peaks(schedule, [10, 100], [0, 0], [5, 7]) == [25, 107]
    # a send holds its tensor until the rank waits for it (`send_waits`), not to the step's end:
    # rank 1 (F0 B0 F1 B1 ...) waits for B0's gradient once F1's activation is in, before F1 runs
    assert activation_peaks(schedule, [10, 100], [0, 0], None, [(0, 1), (0, 2)]) == [20, 100]
    # sends alone: rank 0's activations (F0 F1 B0 F2 ...): F0's waited for after F1 runs, before
    # F1's send, so two at once; rank 1 one gradient at a time (4 and 8 held to the step's end)
    assert activation_peaks(schedule, [0, 0], [0, 0], None, [(1, 0), (0, 2)]) == [2, 2]
    # GPipe's last rank hears nothing back: each gradient waited for after the next backward
    assert activation_peaks(get_schedule("gpipe", 2, 4), [0, 0], [0, 0], None, [(1, 0), (0, 2)]) == [2, 4]


def test_split_backward_holds_pending_bytes_until_the_weight_op():
    # rank 1 of zb-h1: F0 B0 F1 B1 W0 F2 B2 W1 ...: a forward on top of one pending micro-batch
    assert activation_peaks(get_schedule("zb-h1", 2, 4), [10, 100], [0, 30]) == [20, 130]


def test_chimera_ranks_hold_both_pipes_stages():
    schedule = get_schedule("chimera", 2, 4)
    peaks = activation_peaks(schedule, [10, 100], [0, 0])
    # rank 0: 0F0 (10), p1.1F1 (+100), then p1.1B1 frees it: 110 at most
    assert peaks == [110, 110]


def test_bad_arguments_name_the_field():
    shape = ModelShape("bert", 2, 32, 2, 64, VOCAB, S)
    with pytest.raises(ValueError, match="precision"):
        micro_batch_bytes(shape, 1, True, False, B, precision="fp8")
    with pytest.raises(ValueError, match="recompute"):
        micro_batch_bytes(shape, 1, True, False, B, recompute="all")
    with pytest.raises(ValueError, match="stage_bytes"):
        activation_peaks(get_schedule("1f1b", 2, 4), [1], [0, 0])


def _stages_saved(model, shape, batch, precision, num_stages=2):
    """(measured, predicted) bytes per stage: a stage's forward (and loss) under `saved_bytes`, its
    input (sent in the compute dtype) and output held as the stage runtime holds them."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    results, x = [], None
    for index in range(num_stages):
        stage = model.build_stage(index, num_stages, 0).train()
        inputs = None if x is None else x.detach().to(dtype).requires_grad_(True)
        last = index == num_stages - 1

        def forward():
            output = stage(inputs, batch)
            return model.loss(output, batch)[0] if last else output

        measured = saved_bytes(stage, forward, precision, lambda output: (inputs, output))
        predicted = micro_batch_bytes(shape, shape.blocks // num_stages, index == 0, last, B, precision)
        results.append((measured, predicted))
        if not last:
            with torch.no_grad():
                x = stage(inputs, batch)
    return results


def _bert(predictions: int = 0):
    """A two-block BERT, a batch for it and its activation shape (`predictions`: MLM positions)."""
    from pipefisher.models.bert import BertConfig, BertStagedModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=160,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ids = torch.randint(0, VOCAB, (B, S))
    batch = {
        "input_ids": ids,
        "token_type_ids": torch.zeros_like(ids),
        "attention_mask": torch.ones_like(ids),
        "mlm_labels": ids.clone(),
        "nsp_labels": torch.zeros(B, dtype=torch.long),
    }
    if predictions:  # the MLM head on the first `predictions` positions, the only labelled ones
        batch["mlm_labels"][:, predictions:] = -100
        batch["mlm_positions"] = torch.arange(predictions).expand(B, predictions).clone()
    return BertStagedModel(config, S), batch, ModelShape("bert", 2, 48, 3, 160, VOCAB, S, predictions=predictions)


def _tiny():
    """A two-block tiny regression transformer, a batch for it and its activation shape."""
    from pipefisher.config import ModelConfig
    from pipefisher.models.tiny import TinyRegression

    settings = ModelConfig(
        kind="transformer", layers=2, hidden=48, heads=3, ffn=160, seq_len=S, input_dim=16, output_dim=4
    )
    batch = {"inputs": torch.randn(B, S, 16), "targets": torch.randn(B, S, 4)}
    return TinyRegression(settings), batch, ModelShape("tiny", 2, 48, 3, 160, 0, S, inputs=16, outputs=4)


@pytest.mark.parametrize("predictions", [0, 5])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bert_stages_keep_what_autograd_saves(precision, predictions):
    model, batch, shape = _bert(predictions)
    for measured, predicted in _stages_saved(model, shape, batch, precision):
        assert predicted == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tiny_stages_keep_what_autograd_saves(precision):
    model, batch, shape = _tiny()
    for measured, predicted in _stages_saved(model, shape, batch, precision):
        assert predicted == pytest.approx(measured, rel=0.01)


def _stages_in_flight(model, shape, batch, step_cache: bool, micro_batches: int = 3, num_stages: int = 2):
    """(measured, predicted) bytes per stage with `micro_batches` in flight under bf16: the live
    bytes after their forwards (and losses) in one step as the executor runs them (the runtime's
    `Precision` with or without its step cache), each one's input (received in bf16) and output
    held; against that many micro-batches' bytes plus, with the step cache, its one weight copy."""
    precision = Precision("bf16", torch.device("cpu"), step_cache=step_cache)
    results, x = [], None
    for index in range(num_stages):
        stage = model.build_stage(index, num_stages, 0).train()
        first, last = index == 0, index == num_stages - 1

        def forward():
            inputs = None if x is None else x.to(torch.bfloat16).requires_grad_(True)
            with precision.autocast():
                output = stage(inputs, batch)
                return inputs, model.loss(output, batch)[0] if last else output

        with LiveTensorBytes() as probe, precision.step_casts():
            held = [forward() for _ in range(micro_batches)]
            torch.empty(0)  # an op: the probe drops the storages freed since the last one
            measured = probe.current
        blocks = shape.blocks // num_stages
        kept = micro_batch_bytes(shape, blocks, first, last, B, "bf16", weight_casts=not step_cache)
        cached = step_cast_bytes(shape, blocks, first, last, "bf16") if step_cache else 0
        results.append((measured, micro_batches * kept + cached))
        if not last:
            x = held[0][1].detach().float()
    return results


@pytest.mark.parametrize("step_cache", [True, False], ids=["step-cache", "cast-per-forward"])
@pytest.mark.parametrize("kind", ["bert", "tiny"])
def test_bf16_weight_copies_count_once_per_step_with_the_step_cache(kind, step_cache):
    # ZeRO-0/1 keep one copy of the cast weights for the step, ZeRO-2/3 one per micro-batch in flight
    model, batch, shape = _bert() if kind == "bert" else _tiny()
    for measured, predicted in _stages_in_flight(model, shape, batch, step_cache):
        assert predicted == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_backward_transients_count_the_weight_gradients_before_their_accumulation(precision):
    # each stage's backward as the runtime runs it: the gradients land in the stage's buffer (one
    # `.grad` view per parameter), the weights cast once by the step cache; the live bytes' peak in
    # the backward beyond those held when it starts (the forward's, a backward frees them as it goes)
    model, batch, shape = _bert()
    shape = dataclasses.replace(shape, positions=model.config.max_position_embeddings)
    precision_ = Precision(precision, torch.device("cpu"))
    x = None
    for index in range(2):
        stage = model.build_stage(index, 2, 0).train()
        for parameter in stage.parameters():
            parameter.grad = torch.zeros_like(parameter)
        last = index == 1
        with precision_.step_casts(), LiveTensorBytes() as probe:
            inputs = None if x is None else x.to(precision_.compute_dtype).requires_grad_(True)
            with precision_.autocast():
                output = stage(inputs, batch)
                target = model.loss(output, batch)[0] if last else output
            received = None if last else torch.ones_like(target)  # the gradient from the next stage
            held = probe.current
            probe.peak = held
            torch.autograd.backward(target, received)
        predicted = backward_transient_bytes(shape, index == 0, last, B, precision, weight_casts=False, blocks=1)
        # the first stage's peak: a block's weight gradient; the last's: the loss's two b·s·V gradients
        assert probe.peak - held <= predicted <= 1.2 * (probe.peak - held)
        x = None if last else output.detach().float()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt2_stages_keep_what_autograd_saves(precision):
    pytest.importorskip("transformers")
    from pipefisher.models.hf import HfStagedModel, load_hf_config

    config = load_hf_config("gpt2-tiny", vocab_size=VOCAB, n_layer=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, VOCAB, (B, S))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    shape = ModelShape("gpt2", 2, config.n_embd, config.n_head, config.n_inner, VOCAB, S)
    for measured, predicted in _stages_saved(HfStagedModel("GPT2LMHeadModel", config, S), shape, batch, precision):
        assert predicted == pytest.approx(measured, rel=0.01)


def test_the_planner_counts_one_weight_copy_per_step_unless_zero_shards_the_parameters():
    sizes = model_sizes(load_config(BERT_BASE))
    layout = Layout(4, 2, 1, "1f1b", 1, 8, 8, zero=1, method="adamw")
    cached = activation_per_rank(layout, sizes, "bf16")
    per_forward = activation_per_rank(dataclasses.replace(layout, zero=2), sizes, "bf16")
    blocks = sizes.shape.blocks // 4
    copy = 2 * blocks * block_linear_elements(sizes.shape)[0]  # the weights a micro-batch's graph saves
    step = step_cast_bytes(sizes.shape, blocks, False, False, "bf16")  # the step cache: weights and biases
    for rank in (1, 2):  # middle stages of 1F1B: 4 - rank micro-batches in flight at the peak
        assert per_forward[rank] - cached[rank] == (4 - rank) * copy - step
    assert activation_per_rank(layout, sizes) == activation_per_rank(dataclasses.replace(layout, zero=2), sizes)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "blocks"])
def test_predicted_peak_per_rank_is_within_ten_percent_of_live_tensor_bytes(recompute):
    from pipefisher.config import load_config
    from pipefisher.runtime.training.launch import run_group
    from pipefisher.runtime.training.memory_check import measure, predict

    config = load_config("schedules/tiny-cpu.yaml")
    change = lambda section, **values: dataclasses.replace(getattr(config, section), **values)
    config = dataclasses.replace(
        config,
        optimizer=change("optimizer", name="adamw"),
        model=change("model", seq_len=32, recompute=recompute),
        data=change("data", micro_batch_size=16),
        run=change("run", steps=2),
    )
    predicted = predict(config)
    measured = run_group(measure, config.world_size, (config,), timeout=120)
    for peak, live in zip(predicted, measured):
        assert (
            peak.activation_bytes > (0.3 if recompute == "none" else 0.1) * live
        )  # activations are a real share of the peak
        assert peak.total_bytes == pytest.approx(live, rel=0.10)
