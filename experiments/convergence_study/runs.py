"""The convergence study's runs: workloads, settings, and one reference run with held-out
evaluation, each result cached as JSON so that a killed study loses nothing.

A run is `train_reference` (the single-process twin of the pipelined training) of a workload's
run file with the study's overrides; every `Sizing.eval_every` steps its loss on
`Sizing.eval_batches` fixed micro-batches of held-out documents (`data.holdout`) is recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIRST_ORDER = ("adamw", "lamb")


@dataclass(frozen=True)
class Workload:
    """A demo run file, the loss part the study judges (held-out) and that loss's name."""

    name: str
    run_file: str
    part: str
    loss: str
    label: str


WORKLOADS = {
    "bert": Workload("bert", "schedules/tiny-cpu.yaml", "mlm", "MLM", "BERT MLM (bert-4x128)"),
    "gpt2": Workload("gpt2", "schedules/gpt2-tiny-cpu.yaml", "loss", "LM", "GPT-2 causal LM (gpt2-tiny)"),
}


@dataclass(frozen=True)
class Sizing:
    """The study's size knobs, the same for every run of a workload: `steps` (warm-up
    `warmup` then linear decay to 0, clipping 1.0), `micro_batches` of `micro_batch_size`
    sequences of `seq_len` tokens per step, a tokenizer of `vocab_size`, `holdout` of the
    documents held out, evaluated every `eval_every` steps on `eval_batches` micro-batches of them."""

    steps: int = 600
    warmup: int = 30
    micro_batches: int = 4
    micro_batch_size: int = 2
    seq_len: int = 32
    vocab_size: int = 2000
    holdout: float = 0.1
    eval_every: int = 25
    eval_batches: int = 24


@dataclass(frozen=True)
class Setting:
    """One run: `lr` is AdamW/LAMB's optimizer.lr, or the method section's lr (with optimizer.lr =
    `base_lr`, the tuned AdamW lr, for what the method does not precondition); `k` its refresh interval."""

    workload: str
    method: str
    lr: float
    seed: int
    base_lr: float | None = None
    k: int = 0

    @property
    def name(self) -> str:
        extra = f" k {self.k} adamw-lr {self.base_lr:g}" if self.method not in FIRST_ORDER else ""
        return f"{self.workload} {self.method} lr {self.lr:g}{extra} seed {self.seed}"


def overrides(workload: Workload, sizing: Sizing) -> dict[str, dict]:
    """The study's run-file overrides of `workload` (the same keys `pipefisher run --SECTION.KEY` takes)."""
    return {
        "model": {"seq_len": sizing.seq_len, "dropout": 0.0},
        "data": {
            "micro_batch_size": sizing.micro_batch_size,
            "vocab_size": sizing.vocab_size,
            "holdout": sizing.holdout,
        },
        "pipeline": {"schedule": "1f1b", "stages": 2, "micro_batches": sizing.micro_batches, "data_parallel": 1},
        "optimizer": {"warmup_steps": sizing.warmup, "decay": "linear", "decay_steps": 0, "clip_norm": 1.0},
        "run": {"steps": sizing.steps},
    }


def make_config(setting: Setting, sizing: Sizing):
    from pipefisher.config import load_config

    workload = WORKLOADS[setting.workload]
    changes = overrides(workload, sizing)
    changes["run"] = {**changes["run"], "seed": setting.seed}
    changes["data"] = {**changes["data"], "seed": setting.seed}
    if setting.method in FIRST_ORDER:
        changes["optimizer"] = {**changes["optimizer"], "name": setting.method, "lr": setting.lr}
    else:
        changes["optimizer"] = {**changes["optimizer"], "name": setting.method, "lr": setting.base_lr}
        changes[setting.method] = {"lr": setting.lr, "refresh_steps": setting.k, **rest_rule(workload, setting.method)}
    return load_config(ROOT / workload.run_file).with_overrides(**changes)


def rest_rule(workload: Workload, method: str) -> dict[str, str]:
    """AdamW for what `method` does not precondition, where its section names that rule
    (`first_order`: adamw, lamb or sgd; the BERT demo's run file says lamb, its baseline)."""
    from pipefisher.config import load_config

    rule = getattr(load_config(ROOT / workload.run_file).section(method), "first_order", None)
    return {"first_order": "adamw"} if rule in ("adamw", "lamb", "sgd") else {}


def cache_path(setting: Setting, sizing: Sizing, cache: Path) -> Path:
    key = json.dumps([asdict(setting), asdict(sizing)], sort_keys=True)
    return cache / f"{setting.workload}-{setting.method}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


@dataclass(frozen=True)
class RunResult:
    """Held-out evaluations [(steps done, judged loss)], the training loss per step, seconds."""

    evals: list[tuple[int, float]]
    train: list[float]
    seconds: float


def cached(setting: Setting, sizing: Sizing, cache: Path) -> RunResult | None:
    path = cache_path(setting, sizing, cache)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return RunResult([tuple(e) for e in data["evals"]], data["train"], data["seconds"])


def run(setting: Setting, sizing: Sizing, cache: Path) -> RunResult:
    """The run of `setting`, from the cache or trained now in this process (one thread) and cached."""
    found = cached(setting, sizing, cache)
    if found is not None:
        return found
    found = train(make_config(setting, sizing), sizing, WORKLOADS[setting.workload].part)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache_path(setting, sizing, cache)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"setting": asdict(setting), **asdict(found)}))
    partial.replace(path)
    return found


def train(config: Any, sizing: Sizing, part: str) -> RunResult:
    """`config` trained now in this process (one thread), its loss part `part` evaluated on
    held-out documents every `sizing.eval_every` steps."""
    import warnings

    import torch

    from pipefisher.runtime.training import held_out_batches
    from pipefisher.runtime.training import Evaluation, train_reference

    torch.set_num_threads(1)
    evals: list[tuple[int, float]] = []
    evaluation = Evaluation(
        sizing.eval_every,
        held_out_batches(config, sizing.eval_batches),
        lambda step, parts: evals.append((step, parts[part])),
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train_reference(config, evaluation=evaluation)
    return RunResult(evals, result.losses, time.perf_counter() - start)
