"""Hugging Face models on the pipeline: every schedule trains exactly like the unsplit `transformers`
model object (real gloo ranks held to NCCL's in-order rule), with first-order optimizers and
K-FAC (GPT-2's Conv1D layers included), in fp32 and bf16."""

import pytest
import torch

pytest.importorskip("transformers")

from _workers import pipelined  # noqa: E402
from pipefisher.config import config_from_dict  # noqa: E402
from pipefisher.runtime.training.assembly import staged_model  # noqa: E402
from pipefisher.runtime.training.launch import run_group  # noqa: E402
from pipefisher.runtime.training.reference import train_reference  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]
DATA = {"gpt2-tiny": "causal", "llama-tiny": "causal", "bert-tiny": "bert"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf-cache"))


def hf_run(cache, hf_config="gpt2-tiny", schedule="1f1b", **sections):
    """Two stages of a shipped tiny config, 4 micro-batches of 2 sequences of 16 tokens, a
    300-token vocabulary, in-order mode."""
    base = {
        "model": {"kind": "hf", "hf_config": hf_config, "seq_len": 16, "dropout": 0.0},
        "data": {"kind": DATA[hf_config], "vocab_size": 300, "micro_batch_size": 2, "cache_dir": cache},
        "pipeline": {"schedule": schedule, "stages": 2, "micro_batches": 4},
        # SGD: Adam would turn the rounding noise of gradients that are zero in exact arithmetic
        # (attention key biases) into steps of size lr, in the pipeline and the reference alike
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "run": {"steps": 3, "timeout": 60, "master_port": 0, "in_order": True},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return config_from_dict(base)


def assert_equals_the_unsplit_model(config, parameter_atol=1e-6):
    """Losses (rtol 1e-5) and every parameter of every rank equal the unsplit model's; a tied copy
    equals the weight it is tied to."""
    reference = train_reference(config)
    tied = staged_model(config).tied
    results = run_group(pipelined, config.world_size, args=(config,), timeout=60, deadline=300)
    seen = set()
    for result in results:
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
        for key, value in result.parameters.items():
            name = key.split(".", 2)[2] if key.startswith("p1.") else key.split(".", 1)[1]
            name = name if name in reference.parameters else tied[name]
            torch.testing.assert_close(value, reference.parameters[name], rtol=1e-5, atol=parameter_atol)
            seen.add(name)
    assert seen == set(reference.parameters), "every parameter of the unsplit model lives on some rank"
    assert reference.losses[-1] < reference.losses[0]
    return reference


@pytest.mark.parametrize("hf_config, schedule", list(zip(DATA, ["1f1b", "gpipe", "chimera"])))
def test_pipelined_hf_models_equal_the_unsplit_model(hf_config, schedule, cache):
    """Each model on one schedule, each schedule with one model (every schedule on the
    pipefisher models: test_equivalence.py)."""
    assert_equals_the_unsplit_model(hf_run(cache, hf_config, schedule))


@pytest.mark.parametrize("placement", ["packed", "after-step"])
def test_kfac_on_gpt2_equals_kfac_on_the_unsplit_model(placement, cache):
    """K-FAC preconditions GPT-2's Conv1D maps (weights stored transposed) on the pipeline as on
    the unsplit model; the tied vocabulary head, the embeddings and LayerNorm step with AdamW (at
    optimizer.lr: 0.05 would make the loss rise)."""
    config = hf_run(
        cache,
        optimizer={"name": "kfac", "lr": 0.003},
        kfac={
            "lr": 0.05,
            "momentum": 0.9,
            "refresh_steps": 2,
            "placement": placement,
            "factor_decay": 0.5,
            "damping": 0.01,
        },
        run={"steps": 4},
    )
    reference = assert_equals_the_unsplit_model(config, parameter_atol=2e-4)
    first_order = train_reference(config.with_overrides(optimizer={"name": "sgd"}))
    assert reference.losses[2:] != pytest.approx(first_order.losses[2:]), "K-FAC changed the updates"


def test_bf16_gpt2_equals_the_bf16_unsplit_model(cache):
    config = hf_run(cache, run={"precision": "bf16"})
    reference = assert_equals_the_unsplit_model(config)
    fp32 = train_reference(hf_run(cache))
    assert reference.losses != fp32.losses, "bf16 computes in bf16"
