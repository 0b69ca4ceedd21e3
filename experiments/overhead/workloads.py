"""The benchmark's models as run files with overrides, and the run settings every arm of one
comparison shares (`BenchSettings.overrides`), so that only the framework differs between arms."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipefisher.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Workload:
    """A model of the benchmark: `run_file` (relative to the repository) with `model` overrides."""

    name: str
    run_file: str
    model: tuple[tuple[str, Any], ...] = ()
    label: str = ""


WORKLOADS = {
    "bert-tiny": Workload("bert-tiny", "schedules/tiny-cpu.yaml", (("preset", "bert-tiny"),), "BERT-Tiny (2 x 128)"),
    "bert-4x128": Workload("bert-4x128", "schedules/tiny-cpu.yaml", (), "BERT 4 x 128"),
    "bert-base": Workload("bert-base", "schedules/bert-base-1f1b-4x4.yaml", (), "BERT-Base (12 x 768)"),
    "gpt2-tiny": Workload("gpt2-tiny", "schedules/gpt2-tiny-cpu.yaml", (), "HF GPT-2 (4 x 128)"),
    "gpt2-124m": Workload(
        "gpt2-124m",
        "schedules/gpt2-tiny-cpu.yaml",
        (("hf_config", "gpt2"), ("seq_len", 1024)),
        "HF GPT-2 124M (12 x 768)",
    ),
}
CPU_MODELS = ("bert-tiny", "bert-4x128")
GPU_MODELS = ("bert-tiny", "bert-4x128", "bert-base", "gpt2-tiny", "gpt2-124m")


@dataclass(frozen=True)
class BenchSettings:
    """What one comparison runs: `optimizer` (adamw or lamb), `precision` (fp32 or bf16),
    `steps` in all (warm-up included: the learning-rate schedule spans them), `stages` (1 or 2),
    torch.compile of the blocks, `quick` sizes (2 micro-batches of 2 sequences), and
    `micro_batch_size` (sequences per micro-batch; None: the run file's)."""

    optimizer: str
    precision: str
    steps: int
    stages: int
    compile: bool = False
    quick: bool = False
    micro_batch_size: int | None = None

    def overrides(self, workload: Workload, backend: str) -> dict[str, dict[str, Any]]:
        """{section: {key: value}} applied to the workload's run file, in-process and as
        `pipefisher run` flags alike."""
        sections: dict[str, dict[str, Any]] = {
            "model": dict(workload.model),
            "pipeline": {"stages": self.stages, "schedule": "1f1b", "data_parallel": 1},
            "optimizer": {"name": self.optimizer},
            "run": {"steps": self.steps, "precision": self.precision, "backend": backend},
        }
        if self.quick:
            sections["pipeline"]["micro_batches"] = 2
            sections["data"] = {"micro_batch_size": 2}
        if self.micro_batch_size is not None:
            sections.setdefault("data", {})["micro_batch_size"] = self.micro_batch_size
        if self.compile:
            sections["run"]["compile"] = True
        return {section: values for section, values in sections.items() if values}

    def config(self, workload: Workload, backend: str) -> RunConfig:
        return load_config(ROOT / workload.run_file).with_overrides(**self.overrides(workload, backend))

    def flags(self, workload: Workload, backend: str) -> list[str]:
        """The overrides as `pipefisher run`'s `--SECTION.KEY VALUE` flags (values read as YAML)."""
        flags = []
        for section, values in self.overrides(workload, backend).items():
            for key, value in values.items():
                flags += [f"--{section}.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
        return flags
