"""What SOAP costs without bubbles: `pytorch_optimizer.SOAP` against `torch.optim.AdamW` in a plain
PyTorch loop (no pipefisher runtime), on the run file's unsplit model and micro-batches.

The loop is the one the PyTorch docs teach: forward and backward of each micro-batch with the loss
divided by their count (gradient accumulation), global-norm clipping at optimizer.clip_norm, one
optimizer step. One process, one thread. Rounds alternate the two optimizers, so that load from
other processes falls on both alike; per round the median step time of the steps after the first
--skip, per optimizer the median over rounds, and their ratio. Compare it with
`experiments/soap_step_time.py`'s ratio of SOAP packed to AdamW on the pipeline: the bubbles' worth.

    python experiments/soap_plain_loop.py schedules/gpt2-tiny-cpu.yaml --rounds 3 --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipefisher.config import load_config  # noqa: E402
from pipefisher.runtime.training import build_run  # noqa: E402


def optimizer_for(name: str, parameters: list[torch.nn.Parameter], config, refresh_steps: int) -> torch.optim.Optimizer:
    """AdamW at optimizer.lr, or SOAP with its published settings and --refresh-steps."""
    settings = config.optimizer
    if name == "adamw":
        return torch.optim.AdamW(
            parameters,
            lr=settings.lr,
            betas=settings.betas,
            eps=settings.eps,
            weight_decay=settings.weight_decay,
            fused=True,
        )
    from pytorch_optimizer import SOAP

    return SOAP(parameters, lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01, precondition_frequency=refresh_steps)


def step_times(config, name: str, steps: int, skip: int, refresh_steps: int) -> list[float]:
    """Step times (ms) of one plain training run with optimizer `name`, its first `skip` left out."""
    run = build_run(config)
    model = run.model
    net = model.unsplit(config.run.seed)
    optimizer = optimizer_for(name, [p for p in net.parameters() if p.requires_grad], config, refresh_steps)
    batch = run.data_source
    micro_batches = config.pipeline.micro_batches
    times = []
    for step in range(steps):
        start = time.perf_counter()
        for index in range(micro_batches):
            loss, _ = model.unsplit_loss(net, batch(step, index))
            (loss / micro_batches).backward()
        if config.optimizer.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), config.optimizer.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(1000 * (time.perf_counter() - start))
    return times[skip:]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="schedules/gpt2-tiny-cpu.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of each run's median (warm-up, first eigh)")
    parser.add_argument(
        "--refresh-steps", type=int, default=10, help="SOAP's precondition_frequency (the published 10)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_config(args.config)
    medians: dict[str, list[float]] = {"adamw": [], "soap": []}
    for round_ in range(args.rounds):
        for name in medians:
            medians[name].append(statistics.median(step_times(config, name, args.steps, args.skip, args.refresh_steps)))
            print(f"round {round_ + 1}: {name} {medians[name][-1]:.1f} ms/step", flush=True)
    adamw, soap = (statistics.median(medians[name]) for name in ("adamw", "soap"))
    print(
        f"plain loop, median over {args.rounds} rounds: AdamW {adamw:.1f} ms/step, pytorch_optimizer SOAP "
        f"{soap:.1f} ms/step ({soap / adamw:.2f}x)"
    )


if __name__ == "__main__":
    main()
