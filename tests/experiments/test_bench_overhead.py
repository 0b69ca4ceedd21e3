"""experiments/bench_overhead.py: the one-stage comparison runs end to end on the tiny BERT and
both sides train the same thing; bad flags are one line and exit 2."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "bench_overhead.py"


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_the_one_stage_comparison_reports_both_sides_and_their_ratio(tmp_path):
    out = tmp_path / "overhead.md"
    result = bench(
        "--quick", "--arms", "one-stage", "--models", "bert-tiny", "--optimizers", "adamw", "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text in result.stdout + "\n"
    assert "Command: `python experiments/bench_overhead.py --quick" in text
    row = next(
        line for line in text.splitlines() if line.startswith("| bert-tiny | adamw | one-stage | plain PyTorch loop |")
    )
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    baseline, pipefisher, ratio = (float(cell.replace(",", "")) for cell in cells[4:7])
    assert baseline > 0 and pipefisher > 0 and ratio > 0
    (comparison,) = json.loads(out.with_suffix(".json").read_text())["comparisons"]
    assert (
        comparison["arm"] == "one-stage"
        and len(comparison["baseline_seconds"]) == len(comparison["pipefisher_seconds"]) == 1
    )
    # same model, micro-batches and optimizer: the first step's losses agree
    assert comparison["first_loss_relative_difference"] <= 1e-5, comparison["first_losses"]
    assert "repeat 1/1" in result.stderr


def test_a_bad_flag_is_one_line_and_exit_2():
    result = bench("--models", "bert-huge", "--arms", "one-stage")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bench_overhead: error: --models: 'bert-huge' is not one of bert-tiny, bert-4x128, bert-base, gpt2-tiny, gpt2-124m"
    ]


def test_model_flops_count_every_matmul_weight_once_and_the_attention_term():
    """6 x matmul weights x tokens + 12 x layers x hidden x seq_len x tokens, the tied decoder
    counted once; the peak table matches device names as torch reports them."""
    from experiments.overhead.flops import peak_bf16, step_flops

    from pipefisher.config import load_config
    from pipefisher.models.bert import BertStagedModel, bert_preset

    config = load_config(ROOT / "schedules" / "tiny-cpu.yaml").with_overrides(model={"preset": "bert-tiny"})
    vocab, d, ffn, layers, seq = 100, 128, 512, 2, config.model.seq_len
    model = BertStagedModel(bert_preset("bert-tiny", vocab_size=vocab), seq)
    weights = (
        layers * (4 * d * d + 2 * d * ffn) + d * d + d * d + vocab * d + 2 * d
    )  # blocks, pooler, transform, decoder, NSP
    tokens = config.pipeline.micro_batches * config.data.micro_batch_size * seq
    assert (
        step_flops(config, model, model.build_stage(0, 1, 0)) == 6 * weights * tokens + 12 * layers * d * seq * tokens
    )
    assert peak_bf16("NVIDIA H100 80GB HBM3") == 989e12 and peak_bf16("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16("NVIDIA H200") == 989e12 and peak_bf16("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16("NVIDIA H100 NVL") is None and peak_bf16("Tesla T4") is None
