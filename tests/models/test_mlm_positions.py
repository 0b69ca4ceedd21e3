"""Stage kernels a GPU runs fast, with unchanged results: the MLM head on the masked positions only
(`mlm_positions`) gives the full head's loss and gradients, and attention without a mask (a
micro-batch without padding leaves `attention_mask` out) equals attention under an all-ones mask,
for pipefisher's BERT and for Hugging Face models, without a host sync to decide it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipefisher.models.attention import AttentionCore
from pipefisher.models.bert import BertStagedModel
from pipefisher.models.mlm import at_mlm_positions
from tests.models.test_bert import SEQ, SMALL, make_batch, run


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def with_positions(batch: dict[str, torch.Tensor], spare: int = 1) -> dict[str, torch.Tensor]:
    """`batch` with mlm_positions: each row's labelled positions, then `spare` more slots (at
    least) pointing at the row's first unlabelled position, as a data source pads them."""
    labelled = batch["mlm_labels"] != -100
    width = int(labelled.sum(1).max()) + spare
    rows = []
    for row in labelled:
        found, unlabelled = row.nonzero().flatten(), (~row).nonzero().flatten()[:1]
        rows.append(torch.cat([found, unlabelled.repeat(width - len(found))]))
    return batch | {"mlm_positions": torch.stack(rows)}


def gradients(stages) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": p.grad for i, stage in enumerate(stages) for name, p in stage.named_parameters()}


def loss_and_gradients(model: BertStagedModel, num_stages: int, batch: dict[str, torch.Tensor]):
    stages = [model.build_stage(i, num_stages, seed=4).double() for i in range(num_stages)]
    output = run(stages, batch)
    total, parts = model.loss(output, batch)
    total.backward()
    return output, total, parts, gradients(stages)


@pytest.mark.parametrize("num_stages", [1, 2])
def test_head_on_masked_positions_gives_the_full_heads_loss_and_gradients(num_stages: int) -> None:
    model = BertStagedModel(SMALL, SEQ)
    full_batch = make_batch(batch=4, seed=7)
    full_batch["mlm_labels"][:, 0] = -100  # position 0 unlabelled, so padded slots can point at it
    batch = with_positions(full_batch)
    width = batch["mlm_positions"].shape[1]
    assert width < SEQ and (batch["mlm_positions"] == 0).any(), "a real subset, with padded slots"
    (full_mlm, full_nsp), full_total, full_parts, full_grads = loss_and_gradients(model, num_stages, full_batch)
    (mlm, nsp), total, parts, grads = loss_and_gradients(model, num_stages, batch)
    assert full_mlm.shape == (4, SEQ, SMALL.vocab_size) and mlm.shape == (4, width, SMALL.vocab_size)
    torch.testing.assert_close(mlm, at_mlm_positions(full_mlm, batch), rtol=0, atol=1e-12)
    torch.testing.assert_close(nsp, full_nsp, rtol=0, atol=0)
    torch.testing.assert_close(total, full_total, rtol=1e-14, atol=0)
    torch.testing.assert_close(parts, full_parts, rtol=1e-14, atol=0)
    assert grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-14, msg=name)
    # with one stage the decoder's weight is the word embedding's Parameter, named once
    decoder = "0.embeddings.word_embeddings.weight" if num_stages == 1 else "1.cls.predictions.decoder.weight"
    assert decoder in grads and grads[decoder].abs().sum() > 0, "the tied decoder still gets its gradient"


def test_attention_without_a_mask_equals_an_all_ones_mask() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=generator) for _ in range(3))
    core = AttentionCore()
    torch.testing.assert_close(core(q, k, v), core(q, k, v, torch.ones(2, 1, 1, 5, dtype=torch.bool)))
    padded = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    padded[0, ..., 3:] = False
    assert not torch.allclose(core(q, k, v), core(q, k, v, padded)), "the comparison can fail"


@pytest.mark.parametrize("num_stages", [1, 2])
def test_bert_on_an_unpadded_batch_is_the_same_without_its_mask(num_stages: int) -> None:
    model = BertStagedModel(SMALL, SEQ)
    masked = make_batch(batch=2, seed=3)
    masked["attention_mask"].fill_(1)
    unmasked = {key: value for key, value in masked.items() if key != "attention_mask"}
    (mlm, nsp), total, _, grads = loss_and_gradients(model, num_stages, unmasked)
    (mlm_masked, nsp_masked), total_masked, _, grads_masked = loss_and_gradients(model, num_stages, masked)
    torch.testing.assert_close(mlm, mlm_masked, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(nsp, nsp_masked, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, total_masked, rtol=1e-12, atol=0)
    for name, grad in grads_masked.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-13, msg=name)


class HostSyncs(TorchDispatchMode):
    """Counts ATen ops that read a device value back to the host (`.item()`, `bool(tensor)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._overloadpacket.__name__ in ("_local_scalar_dense", "item")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_hf_stages_attend_without_a_mask_or_a_host_sync_when_nothing_is_padded(name: str) -> None:
    pytest.importorskip("transformers")
    from tests.models.test_hf import batch_for, chained, staged

    model = staged(name)
    masked = batch_for(model, seed=2)
    masked["attention_mask"] = torch.ones_like(masked["input_ids"])
    unmasked = {key: value for key, value in masked.items() if key != "attention_mask"}
    stages = [model.build_stage(index, 2, seed=1) for index in range(2)]
    assert stages[0].config._attn_implementation == "sdpa"
    stand_in = torch.empty(3, masked["input_ids"].shape[1], 1)
    with HostSyncs() as syncs:
        context = stages[1].layout.context(stages[1], stand_in, unmasked)
    assert context["attention_mask"] is None and syncs.count == 0
    loss, _ = chained(stages, model, unmasked)
    expected, _ = chained(stages, model, masked)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    unsplit = model.unsplit(seed=1)
    torch.testing.assert_close(loss, model.unsplit_loss(unsplit, unmasked)[0], rtol=1e-6, atol=0)


def test_hf_bert_head_on_masked_positions_gives_the_unsplit_models_loss_and_gradients() -> None:
    pytest.importorskip("transformers")
    from tests.models.test_hf import batch_for, chained, staged

    model = staged("bert-tiny")
    full_batch = batch_for(model, seed=5)
    full_batch["mlm_labels"][1, 7] = full_batch["input_ids"][1, 7]  # rows with 1 and 2 labels: padded slots
    batch = with_positions(full_batch)
    unsplit = model.unsplit(seed=2)
    expected, expected_parts = model.unsplit_loss(unsplit, full_batch)
    expected.backward()
    stages = [model.build_stage(index, 2, seed=2) for index in range(2)]
    with torch.no_grad():
        assert stages[1](stages[0](None, batch), batch)[0].shape[:2] == batch["mlm_positions"].shape
    loss, parts = chained(stages, model, batch)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(parts, model.unsplit_loss(unsplit, batch)[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(parts["mlm"], expected_parts["mlm"], rtol=1e-6, atol=0)
    reference = dict(unsplit.named_parameters(remove_duplicate=False))
    summed: dict[str, torch.Tensor] = {}
    for stage in stages:
        for key, parameter in stage.named_parameters():
            source = model.tied.get(key, key)  # the decoder's copy holds its share of the tied gradient
            summed[source] = summed.get(source, 0) + parameter.grad
    for key, gradient in summed.items():
        torch.testing.assert_close(gradient, reference[key].grad, rtol=1e-5, atol=1e-7, msg=key)
