"""Parameter and gradient bytes per rank under ZeRO-1, 2 and 3 (docs/zero_memory.md, section
"ZeRO-2/3 with FSDP2"): GPT-2 tiny (schedules/gpt2-tiny-cpu.yaml) on 1 stage x 2 replicas, one
step of 4 micro-batches of 2; right before the optimizer step, the bytes of the storages of every
parameter and gradient a rank holds (a DTensor's local shard), against the lecture's arithmetic
(ZeRO-1: 4Ψ + 4Ψ per rank in fp32; ZeRO-3: (4Ψ + 4Ψ) / N_d). Takes about half a minute.

    python experiments/zero_sharded_memory.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

import torch  # noqa: E402

from pipefisher.cli.scripts import entry_point  # noqa: E402
from pipefisher.config import RunConfig, load_config  # noqa: E402
from pipefisher.runtime.training import (  # noqa: E402
    ExecutorExtension,
    build_executor,
    local_bytes,
    run_group,
    train_pipelined,
)

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
MiB = 2**20


def held_bytes(rank: int, world: int, config: RunConfig) -> dict[str, int]:
    """Train one step; this rank's parameter and gradient bytes before its optimizer step, and Ψ
    (the stage's parameter count, whole)."""
    executor, _ = build_executor(config, rank, CPU)
    seen: dict[str, int] = {}

    class Probe(ExecutorExtension):
        def before_optimizer_step(self) -> None:
            parameters = [p for stage in executor.stages.values() for p in stage.module.parameters()]
            seen["parameters"] = local_bytes(parameters)
            seen["gradients"] = local_bytes([p.grad for p in parameters if p.grad is not None])
            seen["psi"] = sum(p.numel() for p in parameters)

    executor.extend(Probe())
    train_pipelined(config, rank, CPU, executor=executor)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="data-parallel replicas N_d (default 2)")
    args = parser.parse_args()
    base = load_config(ROOT / "schedules" / "gpt2-tiny-cpu.yaml").with_overrides(
        pipeline={"stages": 1, "data_parallel": args.replicas, "micro_batches": 4},
        data={"micro_batch_size": 2},
        run={"steps": 1, "master_port": 0},
    )
    print("| ZeRO | rank | Ψ | parameters (MiB) | gradients (MiB) | total (MiB) | bytes per parameter |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for zero in (1, 2, 3):
        config = base.with_overrides(optimizer={"zero": zero})
        for rank, seen in enumerate(run_group(held_bytes, config.world_size, args=(config,), timeout=120)):
            total = seen["parameters"] + seen["gradients"]
            print(
                f"| {zero} | {rank} | {seen['psi']:,} | {seen['parameters'] / MiB:.3f} | {seen['gradients'] / MiB:.3f} "
                f"| {total / MiB:.3f} | {total / seen['psi']:.3f} |"
            )
    print(f"lecture: ZeRO-1 8 bytes per parameter, ZeRO-3 8 / {args.replicas} = {8 / args.replicas:.3f}")


if __name__ == "__main__":
    sys.exit(entry_point(main, "zero_sharded_memory"))
