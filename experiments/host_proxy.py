"""A CPU proxy for host-boundness: how many ATen ops a stage dispatches per micro-batch per block
(forward and backward of the whole model as one stage, loss included), how many of them recast
(`aten::_to_copy`, what autocast does to every weight of every micro-batch), and the share of a
micro-batch's host time spent outside ATen ops (Python, autograd bookkeeping, dispatch).

On a GPU every ATen op is at least one kernel launch from the host, so the counts say how many
launches a micro-batch costs and how far batching, fusing or capturing (CUDA graphs) has to go;
they do not depend on the machine's speed, so CI keeps them (tests/experiments/test_host_proxy.py)
and docs/performance.md tracks them. The share outside ATen is timed (torch.profiler), so it is
noisy and only reported.

`--legacy` measures micro-batches as pipefisher built them before issue 43 (every position
through BERT's MLM head, an attention mask in every micro-batch), so one checkout gives the
before and after; `--last-stage` times the run's last stage (forward and backward) on both kinds
side by side, alternated, and prints the medians and their ratio.

    python experiments/host_proxy.py                      # the BERT and GPT-2 demos, fp32 and bf16
    python experiments/host_proxy.py --run schedules/tiny-cpu.yaml --precision fp32
    python experiments/host_proxy.py --run schedules/tiny-cpu.yaml --seq-len 128 --last-stage
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # torch.profiler's start/stop lines off, as in the runtime

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from experiments.common import ROOT  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402
from pipefisher.config import RunConfig, load_config  # noqa: E402
from pipefisher.runtime.training import build_run  # noqa: E402

RUNS = ("schedules/tiny-cpu.yaml", "schedules/gpt2-tiny-cpu.yaml")
PRECISIONS = ("fp32", "bf16")
RECAST = "aten::_to_copy"


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while it is active, by name ("aten::mm", ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[f"aten::{func._overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class StageOps:
    """One micro-batch of a one-stage model: ATen ops of its forward (with the loss) and backward."""

    run: str
    precision: str
    blocks: int
    forward: Counter[str]
    backward: Counter[str]

    @property
    def per_block(self) -> float:
        """All ops of the micro-batch over the blocks (embeddings, head and loss shared out)."""
        return (self.forward.total() + self.backward.total()) / self.blocks

    @property
    def recasts(self) -> int:
        return self.forward[RECAST] + self.backward[RECAST]


def blocks_of(module: nn.Module) -> int:
    """The model's blocks: the most children named by an index ("0", "1", ...) that one of its
    modules holds (a `ModuleList`, or a `ModuleDict` of a Hugging Face stage); 1 when none does."""
    counts = (sum(name.isdigit() for name, _ in child.named_children()) for child in module.modules())
    return max(max(counts, default=0), 1)


def autocast(precision: str) -> AbstractContextManager:
    """The run's autocast on the CPU: bf16 compute with fp32 weights, as pipefisher's bf16 runs."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def legacy_batch(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """`batch` as pipefisher built micro-batches before issue 43: no `mlm_positions` (BERT's MLM
    head on every position) and an `attention_mask` (all ones where the data source left it out)."""
    legacy = {key: value for key, value in batch.items() if key != "mlm_positions"}
    return {"attention_mask": torch.ones_like(batch["input_ids"])} | legacy


def one_stage(config: RunConfig, legacy: bool = False) -> tuple[nn.Module, object, dict]:
    """(the whole model as one stage, its `StagedModel`, micro-batch 0 of step 0) of `config`,
    the micro-batch as pipefisher built it before issue 43 with `legacy`."""
    run = build_run(config)
    batch = run.data_source(0, 0)
    return run.model.build_stage(0, 1, config.run.seed), run.model, legacy_batch(batch) if legacy else batch


def run_config(path: str, seq_len: int | None = None, micro_batch_size: int | None = None) -> RunConfig:
    """Run file `path` (relative to the checkout), with `seq_len` and `micro_batch_size` when given."""
    return load_config(ROOT / path).with_overrides(
        model={"seq_len": seq_len}, data={"micro_batch_size": micro_batch_size}
    )


def stage_ops(config: RunConfig, label: str, precision: str, legacy: bool = False) -> StageOps:
    """The ATen ops of one micro-batch of the one-stage run `config` (named `label`) under
    `precision`; of the micro-batch as built before issue 43 with `legacy`."""
    module, model, batch = one_stage(config, legacy)
    micro_batch(module, model, batch, precision)  # lazy initialisation out of the count
    forward, backward = OpCounter(), OpCounter()
    with forward, autocast(precision):
        loss = model.loss(module(None, batch), batch)[0]
    with backward:
        loss.backward()
    return StageOps(label, precision, blocks_of(module), forward.ops, backward.ops)


def micro_batch(module: nn.Module, model, batch: dict, precision: str) -> None:
    with autocast(precision):
        loss = model.loss(module(None, batch), batch)[0]
    loss.backward()


def outside_aten_share(
    config: RunConfig, precision: str, repeats: int = 5, legacy: bool = False
) -> tuple[float, float]:
    """(median ms of one micro-batch's forward and backward, median share of it outside ATen ops
    under torch.profiler) of the one-stage run `config` (`legacy`: see `one_stage`)."""
    from torch.profiler import ProfilerActivity, profile

    times, shares = [], []
    module, model, batch = one_stage(config, legacy)
    micro_batch(module, model, batch, precision)
    for _ in range(repeats):
        start = time.perf_counter()
        micro_batch(module, model, batch, precision)
        times.append((time.perf_counter() - start) * 1e3)
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            start = time.perf_counter()
            micro_batch(module, model, batch, precision)
            wall_us = (time.perf_counter() - start) * 1e6
        inside_us = sum(e.self_cpu_time_total for e in profiler.key_averages() if e.key.startswith("aten::"))
        shares.append(max(0.0, 1 - inside_us / wall_us))
    return statistics.median(times), statistics.median(shares)


@dataclass(frozen=True)
class LastStageTimes:
    """Forward and backward of a run's last stage on micro-batch 0 of step 0, in ms per repeat:
    `legacy` on the micro-batch as built before issue 43, `built` as the data source builds it."""

    legacy: list[float]
    built: list[float]

    @property
    def ratio(self) -> float:
        """Median time as built over median legacy time (< 1: faster now)."""
        return statistics.median(self.built) / statistics.median(self.legacy)


def last_stage_times(config: RunConfig, precision: str, repeats: int) -> LastStageTimes:
    """`LastStageTimes` of the run `config` (at least 2 stages), both kinds alternated in each
    repeat and which goes first alternated between repeats; the stage's input is random."""
    run, stages = build_run(config), config.pipeline.stages
    if stages < 2:
        raise ValueError(f"pipeline.stages: the last stage of {stages} stage is the whole model; use 2 or more")
    module, model = run.model.build_stage(stages - 1, stages, config.run.seed), run.model
    built = run.data_source(0, 0)
    batches = {"legacy": legacy_batch(built), "built": built}
    shape = model.activation_shape(stages - 2, stages, config.data.micro_batch_size)
    hidden = torch.randn(shape, generator=torch.Generator().manual_seed(0), requires_grad=True)
    times: dict[str, list[float]] = {name: [] for name in batches}

    def step(batch: dict) -> float:
        module.zero_grad(set_to_none=True)
        hidden.grad = None
        start = time.perf_counter()
        with autocast(precision):
            loss = model.loss(module(hidden, batch), batch)[0]
        loss.backward()
        return (time.perf_counter() - start) * 1e3

    for batch in batches.values():
        step(batch)  # lazy initialisation out of the timing
    for repeat in range(repeats):
        for name in sorted(batches, reverse=bool(repeat % 2)):
            times[name].append(step(batches[name]))
    return LastStageTimes(times["legacy"], times["built"])


def table(rows: list[tuple[StageOps, float, float]]) -> list[str]:
    lines = [
        "| run | precision | blocks | ATen ops forward | backward | per block | recasts (`_to_copy`) "
        "| micro-batch (ms) | host time outside ATen |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for ops, ms, share in rows:
        lines.append(
            f"| {ops.run} | {ops.precision} | {ops.blocks} | {ops.forward.total()} | {ops.backward.total()} "
            f"| {ops.per_block:.0f} | {ops.recasts} | {ms:.1f} | {share:.0%} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--run", action="append", help=f"run file, repeatable (default: {', '.join(RUNS)})")
    parser.add_argument("--precision", action="append", choices=PRECISIONS, help="repeatable (default: both)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per row (default 5)")
    parser.add_argument("--seq-len", type=int, help="model.seq_len (default: the run file's)")
    parser.add_argument("--micro-batch-size", type=int, help="data.micro_batch_size (default: the run file's)")
    parser.add_argument("--legacy", action="store_true", help="micro-batches as built before issue 43")
    parser.add_argument("--last-stage", action="store_true", help="time the last stage, legacy vs as built")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for path in args.run or RUNS:
        config = run_config(path, args.seq_len, args.micro_batch_size)
        for precision in args.precision or PRECISIONS:
            if args.last_stage:
                times = last_stage_times(config, precision, args.repeats)
                print(
                    f"{path} {precision} last stage: legacy {statistics.median(times.legacy):.2f} ms, "
                    f"as built {statistics.median(times.built):.2f} ms, ratio {times.ratio:.3f}"
                )
                continue
            one = config.with_overrides(pipeline={"stages": 1})
            ops = stage_ops(one, path, precision, args.legacy)
            rows.append((ops, *outside_aten_share(one, precision, args.repeats, args.legacy)))
            print(f"measured {path} {precision}", file=sys.stderr, flush=True)
    if rows:
        print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "host_proxy"))
