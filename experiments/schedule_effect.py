"""Is there a per-op schedule effect for the planner to learn? The CPU check (`plan_check.py`) saw
GPipe and ZB-H1 steps of the BERT demo run 8-9 % faster than a 1F1B profile predicts. Two
measurements, both side by side and interleaved so that the machine's load hits all alike:

1. `profiles`: the BERT demo (schedules/tiny-cpu.yaml: 2 stages on 2 processes, 4 micro-batches of
   8, LAMB) profiled with `pipefisher profile` under 1F1B, GPipe and ZB-H1, round after round: the
   per-stage forward and backward (+ weight-gradient) medians of each schedule. An op effect shows
   as a schedule whose op times sit outside the others' spread.
2. `order`: one process, one thread, the demo's stage (2 of pipefisher's BERT blocks, width 128,
   sequence 64, micro-batches of 8): forwards and backwards of 4 micro-batches in GPipe's order
   (F F F F B B B B) and in 1F1B's (F F B F B F B B), alternated: the time of the 8 ops, and each
   op's median by its kind and the kind of the op before it.

    python experiments/schedule_effect.py --rounds 3 --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipefisher.cli.scripts import entry_point  # noqa: E402

SCHEDULES = ("1f1b", "gpipe", "zb-h1")
FIELDS = ("forward", "backward", "weight")
GPIPE_ORDER = [("F", m) for m in range(4)] + [("B", m) for m in range(4)]
ONE_F_ONE_B_ORDER = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]


def profiles(rounds: int) -> str:
    """Markdown: per schedule and stage, each field's median over rounds and its range."""
    import yaml

    found: dict[str, list[list[dict]]] = {schedule: [] for schedule in SCHEDULES}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(rounds):
            for schedule in SCHEDULES:
                path = Path(folder) / f"{schedule}-{round_}.yaml"
                command = [sys.executable, "-m", "pipefisher", "profile", "schedules/tiny-cpu.yaml", "--schedule"]
                command += [schedule, "--optimizer", "lamb", "--repeats", "10", "--master-port", "0", "-o", str(path)]
                subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=600)
                found[schedule].append(yaml.safe_load(path.read_text())["stages"])
                print(f"round {round_ + 1}/{rounds}: profiled {schedule}", file=sys.stderr, flush=True)
    lines = ["| schedule | stage | op | median [ms] | range over rounds [ms] |", "|---|---|---|---|---|"]
    for schedule, runs in found.items():
        for stage in range(len(runs[0])):
            for field in FIELDS:
                values = [run[stage].get(field, 0.0) for run in runs]
                if any(values):
                    lines.append(
                        f"| {schedule} | {stage} | {field} | {statistics.median(values):.2f} | "
                        f"{min(values):.2f}–{max(values):.2f} |"
                    )
    return "\n".join(lines)


def order(repeats: int) -> str:
    """Markdown: the 8 ops' time in each order, and per (kind, previous kind) the op's median."""
    import torch

    from pipefisher.models.bert import Encoder, bert_preset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = bert_preset("bert-4x128")
    stage = Encoder(config, range(2))
    inputs = [torch.randn(8, 64, config.hidden_size) for _ in range(4)]
    by_order: dict[str, list[float]] = {"gpipe": [], "1f1b": []}
    by_transition: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for name, ops in (("gpipe", GPIPE_ORDER), ("1f1b", ONE_F_ONE_B_ORDER)):
            held, previous, began = {}, "-", time.perf_counter()
            for kind, micro_batch in ops:
                start = time.perf_counter()
                if kind == "F":
                    held[micro_batch] = stage(inputs[micro_batch], None)
                else:
                    held.pop(micro_batch).sum().backward()
                by_transition.setdefault((kind, previous), []).append(1000 * (time.perf_counter() - start))
                previous = kind
            by_order[name].append(1000 * (time.perf_counter() - began))
    lines = ["| what | median [ms] | samples |", "|---|---|---|"]
    lines += [f"| 8 ops in {name}'s order | {statistics.median(v):.2f} | {len(v)} |" for name, v in by_order.items()]
    lines += [
        f"| {kind} after {'nothing' if before == '-' else before} | {statistics.median(v):.2f} | {len(v)} |"
        for (kind, before), v in sorted(by_transition.items())
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="profiles per schedule, interleaved (default 3)")
    parser.add_argument("--repeats", type=int, default=30, help="alternations of the two orders (default 30)")
    parser.add_argument("--part", choices=("profiles", "order", "both"), default="both", help="what to measure")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        print("schedule_effect: error: --rounds and --repeats must be positive counts", file=sys.stderr)
        return 2
    if args.part in ("profiles", "both"):
        print(profiles(args.rounds) + "\n")
    if args.part in ("order", "both"):
        print(order(args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "schedule_effect"))
