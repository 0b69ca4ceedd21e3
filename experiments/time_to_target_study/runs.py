"""The time-to-target study's runs: one real `pipefisher run` (2 stages, 2 gloo processes of one
thread each) per setting, reading token shards and evaluating held-out loss in the pipeline; each
result kept as a JSON record (`Store.runs`) so that a killed study resumes and a published table
keeps the runs it was made of.

A run's clock is its step records' `train_s` (wall seconds since the first step began, less the
held-out evaluations; host work between steps included); start-up, profiling and packing, before
the first step, are not in it. Records without it (older runs) fall back to the sum of
`step_time_ms`. `clock[i]` pairs the seconds of training done before evaluation i with its loss.
BERT is judged on its held-out MLM loss (`eval_mlm`, as the convergence study judges it), any
other model on `eval_loss`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from experiments.common import checked, run_child
from experiments.convergence_study.runs import FIRST_ORDER, ROOT, WORKLOADS, Sizing, rest_rule

#: steps whose records the median step time skips (allocation, first profile, warm caches)
WARMUP = 4
#: the tokenizer each workload's shards are written with
TOKENIZERS = {"bert": "wordpiece", "gpt2": "bpe"}
#: the default corpus: the English text shipped with Python
CORPUS = ("embedded",)


@dataclass(frozen=True)
class Store:
    """Where the study keeps things: token shards under `cache` (prepared again at will) and one
    JSON record per run under `runs` (results: a published study keeps them beside its report)."""

    cache: Path
    runs: Path


@dataclass(frozen=True)
class Setting:
    """One pipelined run: `lr` is AdamW's optimizer.lr, or the method section's lr (optimizer.lr
    = `base_lr`, the tuned AdamW lr, for what the method does not precondition); `k` > 0 pins the
    method's refresh interval (0: its packer chooses from the profile it measures first)."""

    workload: str
    schedule: str
    method: str
    lr: float
    seed: int
    base_lr: float | None = None
    k: int = 0

    @property
    def name(self) -> str:
        extra = f" adamw-lr {self.base_lr:g}" if self.method not in FIRST_ORDER else ""
        return f"{self.workload} {self.schedule} {self.method} lr {self.lr:g}{extra} seed {self.seed}"


@dataclass(frozen=True)
class PipelinedRun:
    """What one run's step records say: held-out `evals` [(steps done, loss)], the same losses
    against training seconds `clock` [(s, loss)], every step's wall time `step_ms` [ms], the run's
    own exposed optimizer time share (None: no refresh cycle finished), its refresh interval `k`
    (0: first-order) and the wall time of the whole command `wall_s` [s] (start-up included)."""

    evals: list[tuple[int, float]]
    clock: list[tuple[float, float]]
    step_ms: list[float]
    exposed_share: float | None
    k: int
    wall_s: float
    cached: bool = field(default=False, compare=False)

    @property
    def median_step_ms(self) -> float:
        """Median step time [ms] after the `WARMUP` steps (all steps when the run is shorter)."""
        return statistics.median(self.step_ms[WARMUP:] or self.step_ms)


def parse_records(records: list[dict], wall_s: float) -> PipelinedRun:
    """A `PipelinedRun` of a run's step records (one dict per step, in order)."""
    evals, clock, step_ms, seconds = [], [], [], 0.0
    for record in records:
        step_ms.append(float(record["step_time_ms"]))
        seconds = float(record["train_s"]) if "train_s" in record else seconds + step_ms[-1] / 1000
        if "eval_loss" in record:
            loss = float(record.get("eval_mlm", record["eval_loss"]))
            loss = loss if math.isfinite(loss) else math.inf
            evals.append((int(record["step"]), loss))
            clock.append((seconds, loss))
    shares = [r["exposed_share"] for r in records if "exposed_share" in r]
    k = int(records[-1].get("refresh_steps", 0)) if records else 0
    return PipelinedRun(evals, clock, step_ms, shares[-1] if shares else None, k, wall_s)


def shards(workload: str, sizing: Sizing, cache: Path, corpus: tuple[str, ...] = CORPUS) -> Path:
    """The workload's token shards (the `pipefisher data prepare` inputs `corpus`, its tokenizer of
    `sizing.vocab_size`, `sizing.holdout` of the documents in `valid`), prepared once under `cache`."""
    tag = "embedded" if corpus == CORPUS else hashlib.sha256(json.dumps(corpus).encode()).hexdigest()[:12]
    folder = cache / f"shards-{tag}-{TOKENIZERS[workload]}-{sizing.vocab_size}-{sizing.holdout:g}"
    if not (folder / "manifest.json").is_file():
        command = [sys.executable, "-m", "pipefisher", "data", "prepare", *corpus, "-o", str(folder)]
        command += ["--tokenizer", TOKENIZERS[workload], "--vocab-size", str(sizing.vocab_size)]
        command += ["--holdout", str(sizing.holdout), "--shuffle-seed", "0", "--overwrite"]
        checked(run_child(command, cwd=ROOT), command)
    return folder


def command(setting: Setting, sizing: Sizing, data: Path, metrics: Path) -> list[str]:
    """The `pipefisher run` of `setting` with the study's sizes, writing its records to `metrics`."""
    workload = WORKLOADS[setting.workload]
    keys: dict[str, object] = {
        "model.seq_len": sizing.seq_len,
        "model.dropout": 0.0,
        "data.kind": "shards",
        "data.shards": data,
        "data.micro_batch_size": sizing.micro_batch_size,
        "data.seed": setting.seed,
        "pipeline.stages": 2,
        "pipeline.micro_batches": sizing.micro_batches,
        "pipeline.data_parallel": 1,
        "optimizer.warmup_steps": sizing.warmup,
        "optimizer.decay": "linear",
        "optimizer.decay_steps": 0,
        "optimizer.clip_norm": 1.0,
        "run.seed": setting.seed,
        "run.eval_every": sizing.eval_every,
        "run.eval_batches": sizing.eval_batches,
        "optimizer.lr": setting.lr if setting.method in FIRST_ORDER else setting.base_lr,
    }
    if setting.method not in FIRST_ORDER:
        keys[f"{setting.method}.lr"] = setting.lr
        keys[f"{setting.method}.refresh_steps"] = setting.k
        keys.update({f"{setting.method}.{k}": v for k, v in rest_rule(workload, setting.method).items()})
    head = [sys.executable, "-m", "pipefisher", "run", workload.run_file, "--steps", str(sizing.steps)]
    head += ["--schedule", setting.schedule, "--optimizer", setting.method, "--master-port", "0"]
    return head + ["--metrics", str(metrics)] + [item for k, v in keys.items() for item in (f"--{k}", str(v))]


def record_path(setting: Setting, sizing: Sizing, runs: Path, corpus: tuple[str, ...] = CORPUS) -> Path:
    """The record of `setting` at `sizing` under `runs` (named by a digest of both and the corpus)."""
    key = json.dumps([asdict(setting), asdict(sizing)] + ([list(corpus)] if corpus != CORPUS else []), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return runs / f"{setting.workload}-{setting.schedule}-{setting.method}-{digest}.json"


def cached(setting: Setting, sizing: Sizing, runs: Path, corpus: tuple[str, ...] = CORPUS) -> PipelinedRun | None:
    """The recorded run of `setting`, None when there is no record under `runs`."""
    path = record_path(setting, sizing, runs, corpus)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())["result"]
    data["evals"] = [tuple(e) for e in data["evals"]]
    data["clock"] = [tuple(c) for c in data["clock"]]
    return PipelinedRun(**{**data, "cached": True})


def measured_on(setting: Setting, sizing: Sizing, runs: Path, corpus: tuple[str, ...] = CORPUS) -> str:
    """The machine the record of `setting` was measured on, in words ("not recorded": an older record)."""
    path = record_path(setting, sizing, runs, corpus)
    found = json.loads(path.read_text()).get("machine") if path.is_file() else None
    if not found:
        return "not recorded"
    return f"{found['cpu']}, {found['cores']} cores, {'/'.join(found['vector']) or 'no AVX'}"


def run(setting: Setting, sizing: Sizing, store: Store, corpus: tuple[str, ...] = CORPUS) -> PipelinedRun:
    """The run of `setting`, from its record or launched now (one thread per process) and recorded."""
    found = cached(setting, sizing, store.runs, corpus)
    if found is not None:
        return found
    data = shards(setting.workload, sizing, store.cache, corpus)
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "metrics.jsonl"
        argv = command(setting, sizing, data, metrics)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        start = time.perf_counter()
        checked(run_child(argv, cwd=ROOT, env=env), argv)
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        found = parse_records(records, time.perf_counter() - start)
    path = record_path(setting, sizing, store.runs, corpus)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    result = {k: v for k, v in asdict(found).items() if k != "cached"}
    record = {"setting": asdict(setting), "sizing": asdict(sizing), "corpus": list(corpus), "result": result}
    record["machine"] = machine()
    partial.write_text(json.dumps(record) + "\n")
    partial.replace(path)
    return found


def machine() -> dict[str, object]:
    """What the run's seconds were measured on: CPU model, cores, vector units, date (UTC)."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name", "unknown"),
        "cores": os.cpu_count(),
        "vector": [f for f in ("avx2", "avx512f", "amx_tile") if f in flags],
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
