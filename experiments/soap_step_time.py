"""SOAP's pipelined step against AdamW's, and where SOAP's per-step work goes.

1. Step times: `pipefisher run CONFIG --json` with AdamW, with SOAP packed into the bubbles and
   with SOAP after-step (the refresh work in one block after each cycle's first step), both at the
   refresh interval --refresh-steps (the published 10); --rounds rounds, the three variants
   interleaved in each, so that load from other processes falls on all of them alike. Per run the
   median step time of the steps after the first --skip; per variant the median over rounds.
2. The step end per stage (one process, one thread, the run file's model split as the run splits
   it): SOAP's work before the optimizer step (directions and statistics, bases in place) and the
   statistics update alone, which is the only part that could move into the next step's bubbles
   (the direction needs the step's final gradient); and each stage's refresh work (IA + IB of every
   matrix), which the packer places in the bubbles. Median of --repeats.

    python experiments/soap_step_time.py schedules/gpt2-tiny-cpu.yaml --rounds 3 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "AdamW": ["--optimizer", "adamw"],
    "SOAP packed": ["--optimizer", "soap", "--soap-placement", "packed"],
    "SOAP after-step": ["--optimizer", "soap", "--soap-placement", "after-step"],
}


def step_times(config: str, variant: list[str], steps: int, skip: int, refresh_steps: int) -> list[float]:
    """The step times (ms) of one `pipefisher run`, its first `skip` steps left out."""
    command = [
        sys.executable,
        "-m",
        "pipefisher.cli.main",
        "run",
        config,
        *variant,
        "--steps",
        str(steps),
        "--json",
        "--master-port",
        "0",
        "--soap-refresh-steps",
        str(refresh_steps),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")
    return [json.loads(line)["step_time_ms"] for line in result.stdout.splitlines()][skip:]


def compare(args: argparse.Namespace) -> None:
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    load = []
    for _ in range(args.rounds):
        for name, variant in VARIANTS.items():
            medians[name].append(
                statistics.median(step_times(args.config, variant, args.steps, args.skip, args.refresh_steps))
            )
            load.append(os.getloadavg()[0])
    adamw = statistics.median(medians["AdamW"])
    print(
        f"\n{args.config}: median step time (ms) of steps {args.skip + 1}..{args.steps}, per round and over "
        f"{args.rounds} rounds (load average {min(load):.1f}..{max(load):.1f} on {os.cpu_count()} cores)\n"
    )
    print("| variant | rounds | median | vs AdamW |\n|---|---|---|---|")
    for name, values in medians.items():
        middle = statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:.0f}' for v in values)} | {middle:.0f} | {middle / adamw:.2f} |")


def timed_ms(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples)


def step_end(args: argparse.Namespace) -> None:
    import torch

    from pipefisher.config import load_config
    from pipefisher.methods.soap.engine import SoapEngine
    from pipefisher.methods.soap.step import fold
    from pipefisher.runtime.training import build_run

    torch.set_num_threads(1)
    config = load_config(args.config)
    model = build_run(config).model
    skip = tuple(sorted({f"*{name}" for _, name in model.tied_parameters()}))
    print(f"\nSOAP's work per stage, ms (median of {args.repeats}, one thread):\n")
    print(
        "| stage | matrices | step end: directions + statistics | statistics alone | share | refresh IA + IB (bubbles) |"
    )
    print("|---|---|---|---|---|---|")
    for index in range(config.pipeline.stages):
        module = model.build_stage(index, config.pipeline.stages, config.run.seed)
        engine = SoapEngine(module, config.soap, skip)
        for p in engine.parameters():
            p.grad = torch.randn_like(p)
        engine.precondition_all()  # statistics and first bases
        engine.snapshot()
        states = list(engine._matrices.values())  # the statistics update alone is no public operation
        gradients = [st.parameter.grad.detach().reshape(st.info.shape).clone() for st in states]
        whole = timed_ms(engine.precondition_all, args.repeats)
        folding = timed_ms(
            lambda: fold(states, gradients, engine.settings, engine.statistics_dtype, engine.stack_blocks), args.repeats
        )
        refresh = timed_ms(
            lambda: [engine.refresh(info.name, f) for info in engine.matrices() for f in "AB"], args.repeats
        )
        print(
            f"| {index} | {len(states)} | {whole:.1f} | {folding:.1f} | {100 * folding / whole:.0f} % | {refresh:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a run file (2 stages), e.g. schedules/gpt2-tiny-cpu.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--skip", type=int, default=2, help="first steps left out of each run's median (start-up, first bases)"
    )
    parser.add_argument("--refresh-steps", type=int, default=10, help="SOAP's refresh interval in both placements")
    parser.add_argument("--repeats", type=int, default=5, help="samples of each step-end timing")
    parser.add_argument("--only", choices=["compare", "step-end"], help="run one part only")
    args = parser.parse_args()
    if args.only != "step-end":
        compare(args)
    if args.only != "compare":
        step_end(args)


if __name__ == "__main__":
    main()
