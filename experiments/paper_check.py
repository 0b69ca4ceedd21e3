"""The Megatron-LM paper check: the planner's predicted TFLOP/s per GPU for the GPT runs of Table 1 of
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(SC 2021), on the A100-80GB preset, against the paper's measured figures (issue 46, item 6).

Each row is a GPT model (vocabulary 51,200, 2,048 tokens, FFN 4h, tied embeddings) on DGX A100
nodes (8 GPUs each), the paper's own layout (tensor-parallel T, pipeline P, data-parallel
GPUs / (T P), its global batch, micro-batches of 1 sequence, full activation recomputation,
the interleaved schedule with 2 chunks per rank where P > 1 and the blocks per stage allow it,
else 1F1B), bf16, first-order AdamW, times from flops (`FlopTimes`: P100-calibrated shares of the
A100's 312 TFLOP/s bf16 peak). The planner's `predict` gives the step; TFLOP/s per GPU is the
paper's own count (its eq. 3, recomputation included) over that step and the GPUs:
96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)). Nothing is calibrated on the paper's numbers: they are the
held-out check. Optionally the planner's own search (method adamw; schedules 1F1B, interleaved and
ZB-H1; recompute none or blocks; micro-batch sizes 1, 2, 4) gives its best layout, for the rows of
up to `--search-gpus` GPUs.

    python experiments/paper_check.py --search-gpus 3072 --out /tmp/paper_check.md   # every row (20 min)
    python experiments/paper_check.py --max-gpus 64 --search-gpus 64    # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipefisher.planning.memory.activations import ModelShape  # noqa: E402
from pipefisher.planning.planner.candidates import Layout, SearchSpace  # noqa: E402
from pipefisher.planning.planner.flop_times import FlopTimes  # noqa: E402
from pipefisher.planning.planner.hardware import hardware_of  # noqa: E402
from pipefisher.planning.planner.model_sizes import ModelSizes, PlanError  # noqa: E402
from pipefisher.planning.planner.predict import PlanContext, Prediction, predict  # noqa: E402
from pipefisher.planning.planner.search import GiB, search  # noqa: E402

VOCAB = 51200
SEQ_LEN = 2048
HARDWARE = "a100-80gbx8"


@dataclass(frozen=True)
class Row:
    """One row of the paper's Table 1: parameters (billions), heads, hidden, blocks, tensor- and
    pipeline-parallel degrees, GPUs, global batch (sequences) and achieved TFLOP/s per GPU."""

    billions: float
    heads: int
    hidden: int
    blocks: int
    tensor: int
    pipeline: int
    gpus: int
    batch: int
    tflops: float

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)


#: Table 1 of the paper (see docs/paper_check.md for which entries were checked against which source)
TABLE_1 = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def paper_flops(row: Row) -> float:
    """The paper's eq. 3: flops of one iteration (forward, backward and recomputation)."""
    b, s, layers, h = row.batch, SEQ_LEN, row.blocks, row.hidden
    return 96.0 * b * s * layers * h * h * (1 + s / (6 * h) + VOCAB / (16 * layers * h))


def sizes_of(row: Row) -> ModelSizes:
    shape = ModelShape("gpt2", row.blocks, row.hidden, row.heads, 4 * row.hidden, VOCAB, SEQ_LEN)
    return ModelSizes("hf", f"gpt-{row.billions:g}b", shape, tied=True)


def paper_layout(row: Row) -> Layout:
    """The paper's layout (module docstring)."""
    chunks = 2 if row.pipeline > 1 and (row.blocks // row.pipeline) % 2 == 0 else 1
    return Layout(
        stages=row.pipeline,
        data_parallel=row.data_parallel,
        tensor_parallel=row.tensor,
        schedule="interleaved" if chunks == 2 else "1f1b",
        chunks=chunks,
        micro_batches=row.batch // row.data_parallel,
        micro_batch_size=1,
        method="adamw",
        recompute="blocks",
    )


def context_of(row: Row) -> PlanContext:
    hardware = hardware_of(HARDWARE)
    sizes = sizes_of(row)
    source = FlopTimes.check(sizes, hardware, "bf16", "adamw", None, (1, 2, 4))
    return PlanContext(sizes, source, "adamw", None, 0.0, "bf16", hardware.inter_node_gbps, hardware=hardware)


def tflops(row: Row, prediction: Prediction) -> float:
    """TFLOP/s per GPU: the paper's count per iteration over the predicted step and the GPUs."""
    return paper_flops(row) / (prediction.step_ms / 1e3) / row.gpus / 1e12


def best_layout(row: Row, context: PlanContext) -> tuple[Prediction | str, float]:
    """The planner's own best layout for the row's GPUs and batch (or why there is none), and the
    search's seconds."""
    space = SearchSpace(
        row.gpus,
        row.batch,
        (1, 2, 4),
        schedules=("1f1b", "interleaved", "zb-h1"),
        recompute=("none", "blocks"),
    )
    budget = int((context.hardware.memory_gib - 5.0) * GiB) if context.hardware else 0
    started = time.perf_counter()
    try:
        result = search(space, context, "adamw", budget, top=5, shown=1)
    except PlanError as exc:
        return str(exc).split(": ", 1)[-1], time.perf_counter() - started
    return result.best, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-gpus", type=int, default=3072, help="rows up to this many GPUs (default all)")
    parser.add_argument("--search-gpus", type=int, default=128, help="run the planner's search up to this many GPUs")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    lines = [
        "| model | layout (T x P x D, batch) | paper [TFLOP/s] | predicted [TFLOP/s] | error | step [s] "
        "| memory: state + activations [GiB] | planner's best layout | its TFLOP/s (eq. 3) | its step vs the paper "
        "layout's | search [s] |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in TABLE_1:
        if row.gpus > args.max_gpus:
            continue
        context = context_of(row)
        own = predict(paper_layout(row), context)
        got = tflops(row, own)
        best_text, best_tflops, gain, seconds = "not run", "", "", ""
        if row.gpus <= args.search_gpus:
            best, spent = best_layout(row, context)
            seconds = f"{spent:.0f}"
            if isinstance(best, str):
                best_text = best
            else:
                best_text = f"{best.layout.describe()}, recompute {best.layout.recompute}"
                best_tflops = f"{tflops(row, best):.0f}"
                gain = f"{100 * (best.step_ms / own.step_ms - 1):+.0f} %"
        line = (
            f"| {row.billions:g} B (h {row.hidden}, l {row.blocks}) | {row.tensor} x {row.pipeline} x "
            f"{row.data_parallel}, {row.batch} | {row.tflops:g} | {got:.0f} | {100 * (got / row.tflops - 1):+.0f} % "
            f"| {own.step_ms / 1e3:.2f} | {own.memory.state / GiB:.1f} + {own.memory.activations / GiB:.1f} "
            f"| {best_text} | {best_tflops} | {gain} | {seconds} |"
        )
        lines.append(line)
        print(line, flush=True)
    total = time.perf_counter() - started
    lines.append("")
    lines.append(f"(`python experiments/paper_check.py {' '.join(argv or sys.argv[1:])}`: {total:.0f} s)")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    print(lines[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
