"""A CPU proxy for host-boundness: how many ATen ops a stage dispatches per micro-batch per block
(forward and backward of the whole model as one stage, loss included), how many of them recast
(`aten::_to_copy`, what autocast does to every weight of every micro-batch), and the share of a
micro-batch's host time spent outside ATen ops (Python, autograd bookkeeping, dispatch).

On a GPU every ATen op is at least one kernel launch from the host, so the counts say how many
launches a micro-batch costs and how far batching, fusing or capturing (CUDA graphs) has to go;
they do not depend on the machine's speed, so CI keeps them (tests/experiments/test_host_proxy.py)
and docs/performance.md tracks them. The share outside ATen is timed (torch.profiler), so it is
noisy and only reported.

    python experiments/host_proxy.py                      # the BERT and GPT-2 demos, fp32 and bf16
    python experiments/host_proxy.py --run schedules/tiny-cpu.yaml --precision fp32
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
from torch import nn  # noqa: E402
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


def one_stage(config: RunConfig) -> tuple[nn.Module, object, dict]:
    """(the whole model as one stage, its `StagedModel`, micro-batch 0 of step 0) of `config`."""
    run = build_run(config)
    return run.model.build_stage(0, 1, config.run.seed), run.model, run.data_source(0, 0)


def one_stage_config(path: str) -> RunConfig:
    """Run file `path` (relative to the checkout) with its whole model on one stage."""
    return load_config(ROOT / path).with_overrides(pipeline={"stages": 1})


def stage_ops(config: RunConfig, label: str, precision: str) -> StageOps:
    """The ATen ops of one micro-batch of the one-stage run `config` (named `label`) under `precision`."""
    module, model, batch = one_stage(config)
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


def outside_aten_share(config: RunConfig, precision: str, repeats: int = 5) -> tuple[float, float]:
    """(median ms of one micro-batch's forward and backward, median share of it outside ATen ops
    under torch.profiler) of the one-stage run `config`."""
    from torch.profiler import ProfilerActivity, profile

    times, shares = [], []
    module, model, batch = one_stage(config)
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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for path in args.run or RUNS:
        for precision in args.precision or PRECISIONS:
            config = one_stage_config(path)
            rows.append((stage_ops(config, path, precision), *outside_aten_share(config, precision, args.repeats)))
            print(f"measured {path} {precision}", file=sys.stderr, flush=True)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "host_proxy"))
