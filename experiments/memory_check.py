"""The per-rank memory model (`pipefisher.planning.peak_memory`) against the bytes of live tensors
at the peak of real runs on this CPU (gloo, one process per rank): several schedules, models and
optimizer layouts. Prints a Markdown table (predicted MiB per rank by kind, measured MiB, error)
and writes it into --out between its table markers. About 30 s a layout here.

    python experiments/memory_check.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from pipefisher.runtime.training.stopping import entry_point

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
BEGIN, END = "<!-- memory check table -->", "<!-- end of memory check table -->"

#: (run file, schedule, data-parallel copies, ZeRO stage, micro-batch size, precision, recompute)
LAYOUTS = (
    ("tiny-cpu.yaml", "1f1b", 1, 0, 8, "fp32", "none"),
    ("tiny-cpu.yaml", "gpipe", 1, 0, 8, "fp32", "none"),
    ("tiny-cpu.yaml", "interleaved", 1, 0, 8, "fp32", "none"),
    ("tiny-cpu.yaml", "chimera", 1, 0, 8, "fp32", "none"),
    ("tiny-cpu.yaml", "zb-h1", 1, 0, 8, "fp32", "none"),
    ("tiny-cpu.yaml", "1f1b", 2, 1, 8, "fp32", "none"),
    ("tiny-cpu.yaml", "1f1b", 1, 0, 8, "bf16", "none"),
    ("gpt2-tiny-cpu.yaml", "1f1b", 1, 0, 8, "fp32", "none"),
    ("gpt2-tiny-cpu.yaml", "zb-h1", 1, 0, 8, "fp32", "none"),
    ("tiny-cpu.yaml", "1f1b", 1, 0, 8, "fp32", "blocks"),
    ("tiny-cpu.yaml", "1f1b", 1, 0, 8, "fp32", "selective"),
    ("tiny-cpu.yaml", "zb-h1", 1, 0, 8, "fp32", "selective"),
    ("gpt2-tiny-cpu.yaml", "1f1b", 1, 0, 8, "fp32", "blocks"),
)


def layout_config(run_file: str, schedule: str, data_parallel: int, zero: int, micro_batch_size: int, precision: str,
                  recompute: str):
    """The run file with the layout applied: AdamW, 2 steps, sequences of 64 tokens."""
    from pipefisher.config import load_config

    config = load_config(ROOT / "schedules" / run_file)
    change = lambda section, **values: dataclasses.replace(getattr(config, section), **values)
    return dataclasses.replace(
        config, pipeline=change("pipeline", schedule=schedule, data_parallel=data_parallel),
        optimizer=change("optimizer", name="adamw", zero=zero), model=change("model", seq_len=64, recompute=recompute),
        data=change("data", micro_batch_size=micro_batch_size), run=change("run", precision=precision, steps=2))


def layout_label(run_file: str, schedule: str, data_parallel: int, zero: int, micro_batch: int, precision: str,
                 recompute: str) -> str:
    return (f"{run_file.removesuffix('.yaml')} {schedule}, R={data_parallel}{', ZeRO-1' if zero else ''}, b={micro_batch}, "
            f"{precision}{'' if recompute == 'none' else ', recompute ' + recompute}")


def check(config) -> list[tuple]:
    """(predicted `RankPeak`, measured bytes) per rank of a run."""
    from pipefisher.runtime.training.launch import run_group
    from pipefisher.runtime.training.memory_check import measure, predict

    return list(zip(predict(config), run_group(measure, config.world_size, (config,), timeout=300)))


def table(rows: list[tuple[str, list[tuple]]]) -> list[str]:
    lines = ["| layout | rank | parameters | gradients | optimizer | activations (peak) | p2p buffers | predicted | measured | error |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, ranks in rows:
        for peak, measured in ranks:
            cells = [peak.parameter_bytes, peak.gradient_bytes, peak.optimizer_bytes, peak.activation_bytes,
                     peak.comm_buffer_bytes, peak.total_bytes, measured]
            error = 100 * (peak.total_bytes - measured) / measured
            lines.append(f"| {label} | {peak.rank} | " + " | ".join(f"{cell / MiB:.2f}" for cell in cells) + f" | {error:+.1f} % |")
    return lines


def write_table(path: Path, lines: list[str]) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"--out: {path} has no table markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + rest.split(END, 1)[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "memory_model.md"), help="Markdown file whose table to replace ('' = none)")
    parser.add_argument("--only", type=int, default=0, help="run the first N layouts only (0 = all)")
    parser.add_argument("--match", default="", help="run the layouts whose label contains this text only")
    args = parser.parse_args()
    rows = []
    for layout in LAYOUTS[: args.only or None]:
        if args.match not in (label := layout_label(*layout)):
            continue
        rows.append((label, check(layout_config(*layout))))
        print(table(rows[-1:])[-1], flush=True)
    lines = table(rows)
    print("\n".join(lines))
    if args.out:
        write_table(Path(args.out), lines)
    return 0 if all(abs(peak.total_bytes - measured) <= 0.1 * measured for _, ranks in rows for peak, measured in ranks) else 1


if __name__ == "__main__":
    sys.exit(entry_point(main, "memory_check"))
