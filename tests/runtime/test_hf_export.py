"""`pipefisher export`: a pipelined run's checkpoint loads into `GPT2LMHeadModel.from_pretrained`
and computes the loss the run computed with those parameters."""

import shutil

import pytest
import torch
from tokenizers import Tokenizer

transformers = pytest.importorskip("transformers")

from _workers import checkpointing  # noqa: E402
from pipefisher.cli.main import main  # noqa: E402
from pipefisher.config.reference import resolved_yaml  # noqa: E402
from pipefisher.runtime.training.assembly import data_source  # noqa: E402
from pipefisher.runtime.training.launch import run_group  # noqa: E402
from test_hf_runs import hf_run  # noqa: E402

pytestmark = pytest.mark.dist


def test_an_exported_checkpoint_loads_into_from_pretrained_with_the_same_loss(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    config = hf_run(
        str(tmp_path / "cache"),
        "gpt2-tiny",
        "chimera",
        checkpoint={"dir": str(folder), "every": 2},
        run={"steps": 3, "in_order": False},
    )
    # the run file the user would export from: this configuration as YAML
    run_file = tmp_path / "run.yaml"
    run_file.write_text(resolved_yaml(config))
    losses = run_group(checkpointing, 2, args=(config, False), timeout=60, deadline=240)[0].losses
    # step 3 is the newest checkpoint; keep only step 2, whose parameters computed the loss of step 3
    shutil.rmtree(folder / "step-000003")
    assert main(["export", str(run_file), "-o", str(tmp_path / "hf")]) == 0
    shown = capsys.readouterr().err.splitlines()  # stderr is no terminal here: no progress bar of transformers'
    assert len(shown) == 1 and "GPT2LMHeadModel at step 2" in shown[0], shown

    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    micro_batch = data_source(config)
    total = config.pipeline.micro_batches
    with torch.no_grad():
        loss = sum(float(model(**micro_batch(2, index)).loss) for index in range(total)) / total
    assert loss == pytest.approx(losses[2], rel=1e-5)
    tokenizer = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == model.config.vocab_size


def test_export_refuses_a_model_that_is_not_a_hugging_face_one(tmp_path, capsys):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(f"checkpoint:\n  dir: {tmp_path}\n")
    assert main(["export", str(run_file), "-o", str(tmp_path / "hf")]) == 2
    assert "model.kind: export writes Hugging Face models; this run's model is 'transformer'" in capsys.readouterr().err
