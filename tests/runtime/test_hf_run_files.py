"""Run files with Hugging Face models: the shipped CPU demo trains, and every mistake in a run file
is one line naming the key, exit 2, before any process starts."""

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pipefisher.cli.main import main  # noqa: E402
from pipefisher.config import load_config  # noqa: E402
from pipefisher.runtime.training.assembly import build_schedule, staged_model  # noqa: E402

SCHEDULES = Path(__file__).resolve().parents[2] / "schedules"


def run_file(tmp_path, model="  seq_len: 16\n", data="  kind: causal\n", pipeline="  stages: 2\n"):
    """A run file of a Hugging Face model with these lines in its sections (a 300-token vocabulary,
    its cache in `tmp_path`)."""
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model:\n  kind: hf\n{model}data:\n  vocab_size: 300\n  cache_dir: {tmp_path / 'cache'}\n{data}"
        f"pipeline:\n  micro_batches: 2\n{pipeline}"
    )
    return path


@pytest.mark.parametrize(
    "model, data, pipeline, message",
    [
        (
            "",
            "",
            "  stages: 3\n",
            "model: 4 blocks of transformer.h cannot be split into 3 equal stages; make pipeline.stages a divisor of 4: 1, 2 or 4",
        ),
        (
            "  hf_config: gpt9\n",
            "",
            "",
            "model.hf_config: 'gpt9' is neither a file nor one of gpt2-tiny, bert-tiny, llama-tiny",
        ),
        ("  hf_class: GPT2Model\n", "", "", "model.hf_class: GPT2Model has no block list pipefisher recognises"),
        ("  hf_class: Gpt2\n", "", "", "model.hf_class: 'Gpt2' is not a model class of transformers"),
        (
            "  hf_config: bert-tiny\n",
            "",
            "",
            "data.kind: 'causal' does not fit BertForPreTraining; it needs data.kind bert",
        ),
        ("", "  tokenizer: missing.json\n", "", "data.tokenizer: missing.json does not exist"),
        ("  hf_weights: missing.safetensors\n", "", "", "model.hf_weights: missing.safetensors does not exist"),
        (
            "",
            "  kind: synthetic\n",
            "",
            "data.kind: 'synthetic' does not fit model.kind 'hf'; it needs data.kind causal or bert",
        ),
        ("  seq_len: 4096\n", "", "", "model.seq_len: 4096 exceeds the model's 256 positions"),
    ],
)
def test_bad_hf_run_files_exit_2_naming_the_key(tmp_path, capsys, model, data, pipeline, message):
    path = run_file(
        tmp_path,
        model or "  seq_len: 16\n",
        data if "kind:" in data else f"  kind: causal\n{data}",
        pipeline or "  stages: 2\n",
    )
    assert main(["run", str(path), "--reference"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("pipefisher: error: ") and message in error, error


@pytest.mark.parametrize(
    "model, data, message",
    [
        ("  seq_len: 16\n  hf_weights: {file}\n", "  kind: causal\n", "model.hf_weights: cannot read {file}"),
        ("  seq_len: 16\n", "  kind: causal\n  tokenizer: {file}\n", "data.tokenizer: {file} is not a tokenizer.json"),
    ],
)
def test_files_that_are_not_what_their_key_needs_exit_2_naming_the_key(tmp_path, capsys, model, data, message):
    file = tmp_path / "garbage"
    file.write_text("not this kind of file")
    path = run_file(tmp_path, model.format(file=file), data.format(file=file))
    assert main(["run", str(path), "--reference"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.format(file=file) in error, error


def test_a_config_json_path_is_a_model(tmp_path):
    config = json.loads(
        (Path(__file__).resolve().parents[2] / "pipefisher/models/hf_configs/llama-tiny.json").read_text()
    )
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    loaded = load_config(run_file(tmp_path, f"  seq_len: 16\n  hf_config: {tmp_path / 'config.json'}\n"))
    model = staged_model(loaded)
    assert model.cls.__name__ == "LlamaForCausalLM" and model.num_blocks == 2 and model.config.vocab_size == 300


@pytest.mark.parametrize("name, blocks_per_stage", [("gpt2-tiny-cpu.yaml", 2), ("gpt2-medium-chimera-8x8.yaml", 3)])
def test_the_shipped_hf_run_files_split_their_models(name, blocks_per_stage, tmp_path):
    config = load_config(SCHEDULES / name).with_overrides(data={"cache_dir": str(tmp_path)})
    schedule = build_schedule(config)
    model = staged_model(config)
    assert model.num_blocks == blocks_per_stage * schedule.num_stages


@pytest.mark.slow
@pytest.mark.dist
def test_the_gpt2_demo_learns_on_the_embedded_corpus(tmp_path):
    result = subprocess.run(
        ["pipefisher", "run", str(SCHEDULES / "gpt2-tiny-cpu.yaml"), "--steps", "20", "--master-port", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    losses = [json.loads(line)["loss"] for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0] - 1.0
