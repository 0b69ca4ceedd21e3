"""Step times of the convergence study, per method (results cached as JSON):

- measured: a short real `pipefisher run` of the workload with the study's sizes on this machine
  (2 stages, 1F1B, 2 gloo processes of one thread; a curvature method packed into the bubbles
  with the interval k its packer chooses from the profile it measures first): the median step
  time of the steps after `WARMUP`, and that k;
- paper scale: the step time the packer predicts for the method on the BERT-Large Chimera 8 x 8
  run (`schedules/bert-large-chimera-8x8.yaml`) with the PipeFisher authors' P100 block times
  (`profiles/reference/bert-large_time_memory_p100.csv`, micro-batch 32). Those times are K-FAC's
  tasks: another method's tasks are assumed to cost what K-FAC's cost at the same place (its
  statistics as K-FAC's factors, its refresh as the inversion, its per-step work as the
  preconditioning, paid in the stage's end of step by a method that preconditions in the
  optimizer step). AdamW and LAMB get the first-order step (the profile has no optimizer time).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.common import run_child
from experiments.convergence_study.runs import FIRST_ORDER, ROOT, WORKLOADS, Sizing, overrides, rest_rule

TIMED_STEPS = 14
WARMUP = 4
PAPER_RUN = ROOT / "schedules" / "bert-large-chimera-8x8.yaml"
PAPER_TIMES = ROOT / "profiles" / "reference" / "bert-large_time_memory_p100.csv"


@dataclass(frozen=True)
class StepTime:
    """Median measured step time [ms] here, the packed k (0: first-order), and the step time
    predicted at paper scale [ms] with its k."""

    measured_ms: float
    k: int
    paper_ms: float
    paper_k: int


def measure(workload: str, method: str, sizing: Sizing, k: int = 0) -> tuple[float, int]:
    """(median step time [ms] after the warm-up steps, k) of a real `pipefisher run`; `k` > 0 pins
    a curvature method's interval (0: its packer chooses)."""
    flags = [f"--{section}.{key}" for section, keys in overrides(WORKLOADS[workload], sizing).items() for key in keys]
    values = [str(value) for keys in overrides(WORKLOADS[workload], sizing).values() for value in keys.values()]
    args = [item for pair in zip(flags, values) for item in pair if not pair[0].endswith(".steps")]
    if k:
        args += [f"--{method}.refresh_steps", str(k)]
    args += (
        [item for key, value in rest_rule(WORKLOADS[workload], method).items() for item in (f"--{method}.{key}", value)]
        if method not in FIRST_ORDER
        else []
    )
    command = [
        sys.executable,
        "-m",
        "pipefisher",
        "run",
        WORKLOADS[workload].run_file,
        "--json",
        "--steps",
        str(TIMED_STEPS),
        "--optimizer",
        method,
        "--master-port",
        "0",
        *args,
    ]
    done = run_child(command, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip().splitlines()[-1:]}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    times = [record["step_time_ms"] for record in records[WARMUP:]]
    return statistics.median(times), int(records[-1].get("refresh_steps", 0))


def paper_scale(method: str) -> tuple[float, int]:
    """(predicted step time [ms], k) of `method` on the BERT-Large Chimera 8 x 8 run (P100 times)."""
    from pipefisher.config import load_config
    from pipefisher.methods.registry import task_rules
    from pipefisher.planning.packing.pack import pack
    from pipefisher.planning.simulate import simulate
    from pipefisher.planning.transformer_profile import BERT_SIZES, read_block_times, transformer_profile
    from pipefisher.methods.registry import method_of_profile
    from pipefisher.runtime.training import build_run, pack_options

    config = load_config(PAPER_RUN).with_overrides(optimizer={"name": method})
    blocks, hidden, ffn = BERT_SIZES["bert-large"]
    size = config.data.micro_batch_size
    profile = transformer_profile(
        read_block_times(PAPER_TIMES, size),
        blocks,
        config.pipeline.stages,
        hidden,
        ffn,
        size,
        seq_len=config.model.seq_len,
    )
    schedule = build_run(config).schedule
    if method in FIRST_ORDER:
        return simulate(schedule, profile).step_time, 0
    profile = dataclasses.replace(profile, method=method)
    if not task_rules(method).precondition:  # it preconditions in the optimizer step: the stage's end pays it
        profile = dataclasses.replace(
            profile,
            stages=tuple(
                dataclasses.replace(stage, step_end=stage.step_end + sum(layer.precondition for layer in stage.layers))
                for stage in profile.stages
            ),
        )
    packed = pack(schedule, profile, method_of_profile(profile).rules, pack_options(config))
    return packed.step_time, packed.refresh_steps


def step_time(workload: str, method: str, sizing: Sizing, cache: Path, again: bool = False) -> StepTime:
    """`method`'s step times on `workload`, from the cache or measured now; `again`: measured
    anew at the cached k (all methods back to back under the same load of the machine)."""
    path = (
        cache
        / f"steptime-{workload}-{method}-{sizing.micro_batches}x{sizing.micro_batch_size}x{sizing.seq_len}-{sizing.vocab_size}.json"
    )
    before = StepTime(**json.loads(path.read_text())) if path.is_file() else None
    if before is not None and not again:
        return before
    measured, k = measure(workload, method, sizing, before.k if before else 0)
    paper, paper_k = paper_scale(method)
    found = StepTime(measured, k, paper, paper_k)
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(found)))
    return found
