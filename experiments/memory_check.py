"""The per-rank memory model (`pipefisher.planning.memory.peak`) against the bytes of live tensors
at the peak of real runs on this CPU (gloo, one process per rank): several schedules, models,
optimizer layouts, activation recomputation, and K-FAC, Shampoo, Muon and SOAP (packed, from a
profile measured first; SOAP also at `fold: bubbles`, float32 statistics and helpers).
Prints a Markdown table (predicted MiB per rank by kind, measured MiB, error) and writes it into
--out between its table markers. About 3.5 minutes here (18 layouts).

    python experiments/memory_check.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from pipefisher.cli.scripts import entry_point

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
BEGIN, END = "<!-- memory check table -->", "<!-- end of memory check table -->"


@dataclasses.dataclass(frozen=True)
class Layout:
    """One checked run: the run file with these settings (`optimizer` a curvature method: its
    packed placement, from a profile measured first)."""

    run_file: str
    schedule: str = "1f1b"
    data_parallel: int = 1
    zero: int = 0
    micro_batch_size: int = 8
    precision: str = "fp32"
    recompute: str = "none"
    optimizer: str = "adamw"
    #: (key, value) of the optimizer's section beyond the run file's (a curvature method's)
    settings: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        extras = [f"ZeRO-{self.zero}"] * bool(self.zero) + [f"recompute {self.recompute}"] * (self.recompute != "none")
        extras += [f"{self.optimizer} packed"] * (self.optimizer != "adamw")
        extras += [f"{key} {value}" for key, value in self.settings]
        return ", ".join(
            [
                f"{self.run_file.removesuffix('.yaml')} {self.schedule}",
                f"R={self.data_parallel}",
                f"b={self.micro_batch_size}",
                self.precision,
                *extras,
            ]
        )


LAYOUTS = (
    Layout("tiny-cpu.yaml", "1f1b"),
    Layout("tiny-cpu.yaml", "gpipe"),
    Layout("tiny-cpu.yaml", "interleaved"),
    Layout("tiny-cpu.yaml", "chimera"),
    Layout("tiny-cpu.yaml", "zb-h1"),
    Layout("tiny-cpu.yaml", "1f1b", data_parallel=2, zero=1),
    Layout("tiny-cpu.yaml", "1f1b", precision="bf16"),
    Layout("gpt2-tiny-cpu.yaml", "1f1b"),
    Layout("gpt2-tiny-cpu.yaml", "zb-h1"),
    Layout("tiny-cpu.yaml", "1f1b", recompute="blocks"),
    Layout("tiny-cpu.yaml", "1f1b", recompute="selective"),
    Layout("tiny-cpu.yaml", "zb-h1", recompute="selective"),
    Layout("gpt2-tiny-cpu.yaml", "1f1b", recompute="blocks"),
    Layout("tiny-cpu.yaml", "1f1b", optimizer="kfac"),
    Layout("tiny-cpu.yaml", "1f1b", optimizer="shampoo"),
    Layout("tiny-cpu.yaml", "1f1b", optimizer="muon"),
    Layout("tiny-cpu.yaml", "1f1b", optimizer="soap"),
    Layout(
        "tiny-cpu.yaml",
        "1f1b",
        optimizer="soap",
        settings=(("fold", "bubbles"), ("statistics_dtype", "float32"), ("helpers", True)),
    ),
)


def layout_config(layout: Layout, profile_dir: Path):
    """The run file with the layout applied: 2 steps (a curvature method: two refresh cycles),
    sequences of 64 tokens; a curvature method packs from a profile of this run measured into
    `profile_dir` first."""
    from pipefisher.config import load_config
    from pipefisher.cli.training import profile_run

    config = load_config(ROOT / "schedules" / layout.run_file)
    change = lambda section, **values: dataclasses.replace(getattr(config, section), **values)
    config = dataclasses.replace(
        config,
        pipeline=change("pipeline", schedule=layout.schedule, data_parallel=layout.data_parallel),
        optimizer=change("optimizer", name=layout.optimizer, zero=layout.zero),
        model=change("model", seq_len=64, recompute=layout.recompute),
        data=change("data", micro_batch_size=layout.micro_batch_size),
        run=change("run", precision=layout.precision, steps=2, master_port=0),
    )
    if config.curvature is None:
        return config
    config = config.with_overrides(**{layout.optimizer: dict(layout.settings)})
    profile = profile_dir / f"{layout.optimizer}-{layout.schedule}.yaml"
    if profile_run(config, str(profile), None, repeats=2):
        raise SystemExit(f"{layout.label}: measuring its profile failed")
    section = {"profile": str(profile), "placement": "packed", **dict(layout.settings)}
    return config.with_overrides(**{layout.optimizer: section})


def check(config) -> list[tuple]:
    """(predicted `RankPeak`, measured bytes) per rank of a run."""
    from pipefisher.runtime.training import run_group
    from pipefisher.runtime.training import measure_memory as measure, measured_steps, predict_memory as predict

    steps = measured_steps(config)
    return list(zip(predict(config), run_group(measure, config.world_size, (config, steps), timeout=300)))


def table(rows: list[tuple[str, list[tuple]]]) -> list[str]:
    lines = [
        "| layout | rank | parameters | gradients | optimizer | curvature | activations | captures | refresh copies | p2p buffers | help buffers | predicted | measured | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, ranks in rows:
        for peak, measured in ranks:
            cells = [
                peak.parameter_bytes,
                peak.gradient_bytes,
                peak.optimizer_bytes,
                peak.curvature_bytes,
                peak.activation_bytes,
                peak.capture_bytes,
                peak.refresh_bytes,
                peak.comm_buffer_bytes,
                peak.help_bytes,
                peak.total_bytes,
                measured,
            ]
            error = 100 * (peak.total_bytes - measured) / measured
            lines.append(
                f"| {label} | {peak.rank} | "
                + " | ".join(f"{cell / MiB:.2f}" for cell in cells)
                + f" | {error:+.1f} % |"
            )
    return lines


def write_table(path: Path, lines: list[str]) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"--out: {path} has no table markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + rest.split(END, 1)[1])


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default=str(ROOT / "docs" / "memory_model.md"), help="Markdown file whose table to replace ('' = none)"
    )
    parser.add_argument("--only", type=int, default=0, help="run the first N layouts only (0 = all)")
    parser.add_argument("--match", default="", help="run the layouts whose label contains this text only")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as profile_dir:
        for layout in LAYOUTS[: args.only or None]:
            if args.match in layout.label:
                rows.append((layout.label, check(layout_config(layout, Path(profile_dir)))))
                print(table(rows[-1:])[-1], flush=True)
    lines = table(rows)
    print("\n".join(lines))
    if args.out:
        write_table(Path(args.out), lines)
    return (
        0
        if all(abs(peak.total_bytes - measured) <= 0.1 * measured for _, ranks in rows for peak, measured in ranks)
        else 1
    )


if __name__ == "__main__":
    sys.exit(entry_point(main, "memory_check"))
