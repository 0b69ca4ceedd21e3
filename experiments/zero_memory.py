"""Training-state memory per rank and gradient traffic per step of the paper run (BERT-Base, 4
stages, 1F1B: schedules/bert-base-1f1b-4x4.yaml) with 1, 2 and 4 data-parallel copies, for the
LAMB baseline and for K-FAC (SGD with momentum after preconditioning, the run file's
kfac.first_order rule for what K-FAC leaves, plus K-FAC's factors and inverses): plain data parallelism, ZeRO stage 1, rank-4 PowerSGD, and (K-FAC) one gradient worker
per layer (kfac.grad_worker_fraction 1/R), from `pipefisher.planning.memory.state`.

The stages are the real ones (pipefisher's BERT code, seed 0, on the CPU): parameter sizes and
K-FAC layers are read off them. Then ZeRO's own published example as a sanity check of the same
per-rank code path. Prints a Markdown table and writes it to --out. Takes a few seconds.

    python experiments/zero_memory.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.common import experiment_output  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402
from pipefisher.core.topology import Topology  # noqa: E402
from pipefisher.planning.memory.state import (  # noqa: E402
    ElementBytes,
    OptimizerState,
    RankMemory,
    StageState,
    rank_memory,
)
from pipefisher.schedules import get_schedule  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MiB, GB = 2**20, 10**9
#: kfac.first_order's rule and its state, in words
REST = {
    "lamb": ("LAMB", "LAMB's two fp32 moments"),
    "adamw": ("AdamW", "AdamW's two fp32 moments"),
    "sgd": ("its SGD", "the same"),
}

HEADER = """\
Training-state memory per rank of the PipeFisher paper run ({run}: BERT-Base, {stages} stages, {schedule}, \
micro-batches of {micro_batch} x {seq_len} tokens), from `pipefisher.planning.memory.state` over the real stages built \
by pipefisher's BERT code (seed 0). Counted: fp32 parameters and fp32 gradients (whole on every rank, \
with or without ZeRO-1, as the runtime keeps them), the optimizer's state (LAMB: two fp32 moments; \
K-FAC: SGD's fp32 momentum buffer, momentum {momentum}, for the layers it preconditions, \
{rest} for the parameters it leaves) over the parameters a rank updates (ZeRO-1: \
the ones it owns, `pipefisher.planning.replicas.zero.shard_owners`), and K-FAC's state once a refresh is committed \
(running factors A and B and their committed inverses, fp32, with flags and counters; A includes the \
bias column; every replica keeps every inverse, except with gradient workers: then only the layer's \
workers; the tied MLM decoder stays first-order), and PowerSGD's state (the error of every matrix it \
compresses, its P and Q factors, a copy of the tensors it leaves whole). Not counted: \
activations, K-FAC's captured inputs and output gradients, factors being built, communication and \
temporary buffers, allocator overhead, the CUDA context. Each memory column is the largest value over \
the ranks (columns may come from different ranks; total is the largest per-rank sum). Gradient traffic: \
bytes a rank sends per step for its stage's gradient reduction over its data-parallel copies (ring \
volume: all-reduce, or with ZeRO-1 a reduce to the owners plus their parameter broadcast, the same; \
with PowerSGD an all-reduce of its P and Q factors and of the tensors it leaves whole; with gradient \
workers, plus each layer's preconditioned gradient broadcast to the other replicas); K-FAC's factor \
all-reduces and inverse broadcasts are extra and not in it. MiB = 2^20 bytes.
"""


def stage_states(config) -> list:
    """The run's stages as `pipefisher.planning.memory.state.StageState`s: built for real, then measured."""
    from pipefisher.methods.kfac.layer import preconditioned_parameters, select_layers
    from pipefisher.methods.kfac.memory import KfacLayer
    from pipefisher.planning.memory.state import StageState
    from pipefisher.models.bert import BertStagedModel, bert_preset
    from pipefisher.runtime.training import unique_parameters

    model = BertStagedModel(bert_preset(config.model.preset, vocab_size=config.data.vocab_size), config.model.seq_len)
    stages = []
    for index in range(config.pipeline.stages):
        module = model.build_stage(index, config.pipeline.stages, seed=0)
        layers = select_layers(module, model.first_order_linears())
        parameters = unique_parameters(module)
        owned = {
            id(module.get_parameter(name)) for name in preconditioned_parameters(module, model.first_order_linears())
        }
        stages.append(
            StageState(
                tuple(p.numel() for p in parameters),
                tuple(KfacLayer(name, st.info.a_size, st.info.b_size) for name, st in layers.items()),
                tuple(tuple(p.shape) for p in parameters),
                tuple(id(p) in owned for p in parameters),
            )
        )
        del module
    return stages


def pipefisher_table(config, stages, data_parallels: list[int], momentum: float) -> list[str]:
    from pipefisher.methods.kfac.method import KFAC
    from pipefisher.planning.memory.state import largest, optimizer_state, rank_memory
    from pipefisher.schedules import get_schedule
    from pipefisher.core.topology import Topology

    schedule = get_schedule(config.pipeline.schedule, config.pipeline.stages, config.pipeline.micro_batches)
    lamb, kfac = (
        optimizer_state("lamb"),
        optimizer_state("kfac", momentum, first_order=config.kfac.first_order, memory=KFAC.memory),
    )
    kfac_label = f"K-FAC + SGD (momentum {momentum:g}), {REST[config.kfac.first_order][0]} for the rest"
    lines = [
        (
            "| data-parallel copies | optimizer | data-parallel path | parameters (MiB) | gradients (MiB) | optimizer state (MiB) "
            "| K-FAC state (MiB) | PowerSGD state (MiB) | total (MiB) | gradient traffic (MiB/step) |"
        ),
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for data_parallel in data_parallels:
        topology = Topology(schedule, data_parallel)
        variants = [("LAMB", lamb, "all-reduce", {}), (kfac_label, kfac, "all-reduce", {})]
        if data_parallel > 1:
            variants = [
                ("LAMB", lamb, "all-reduce", {}),
                ("LAMB", lamb, "ZeRO-1", {"zero": 1}),
                ("LAMB", lamb, "PowerSGD rank 4", {"powersgd_rank": 4}),
                (kfac_label, kfac, "all-reduce", {}),
                (kfac_label, kfac, "ZeRO-1", {"zero": 1}),
                (kfac_label, kfac, f"1 gradient worker per layer (f = 1/{data_parallel})", {"workers_per_layer": 1}),
                (kfac_label, kfac, "PowerSGD rank 4", {"powersgd_rank": 4}),
            ]
        for label, optimizer, path, options in variants:
            ranks = rank_memory(topology, stages, optimizer, **options)
            cells = [
                largest(ranks, field) / MiB
                for field in (
                    "parameter_bytes",
                    "gradient_bytes",
                    "optimizer_bytes",
                    "curvature_bytes",
                    "compression_bytes",
                    "total_bytes",
                    "grad_comm_bytes",
                )
            ]
            lines.append(
                f"| {data_parallel} | {label} | {path} | " + " | ".join(f"{cell:,.1f}" for cell in cells) + " |"
            )
    return lines


#: ZeRO's "mixed-precision Adam" (Rajbhandari et al., SC'20, sec. 3.1): fp32 master parameters,
#: momentum and variance, K = 12 bytes per parameter; fp16 parameters and gradients beside them
MIXED_PRECISION_ADAM = OptimizerState("mixed-precision adam", 12)


def zero_paper_example(
    psi: int = 7_500_000_000, data_parallel: int = 64, zero: int = 0, chunks_per_rank: int = 4
) -> RankMemory:
    """Sanity check of this model's per-rank path against ZeRO's own accounting (paper, Figure 1:
    Ψ = 7.5B, Nd = 64 gives 120 GB per device without ZeRO, 31.4 GB with P_os): a one-stage
    model of `psi` parameters, cut into ``chunks_per_rank × data_parallel`` nearly equal tensors,
    fp16 parameters and gradients (2 bytes each) and K = 12 bytes of optimizer state, over
    `data_parallel` replicas. Returns the rank with the most bytes. Not pipefisher's runtime
    accounting (which keeps fp32 parameters and gradients)."""
    chunks = chunks_per_rank * data_parallel
    base, extra = divmod(psi, chunks)
    sizes = tuple(base + (index < extra) for index in range(chunks))
    topology = Topology(get_schedule("1f1b", 1, 1), data_parallel)
    ranks = rank_memory(
        topology, [StageState(sizes)], MIXED_PRECISION_ADAM, zero, ElementBytes(parameter=2, gradient=2)
    )
    return max(ranks, key=lambda rank: rank.total_bytes)


def deepspeed_table() -> list[str]:
    lines = [
        "| case | parameters, fp16 (GB) | gradients, fp16 (GB) | optimizer state, K = 12 (GB) | total (GB) | paper (GB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for zero, label, paper in ((0, "baseline", "120"), (1, "P_os (ZeRO-1)", "31.4")):
        rank = zero_paper_example(zero=zero)
        cells = [rank.parameter_bytes, rank.gradient_bytes, rank.optimizer_bytes, rank.total_bytes]
        lines.append(f"| {label} | " + " | ".join(f"{cell / GB:,.2f}" for cell in cells) + f" | {paper} |")
    return lines


#: where the hand-written sections of the output file begin (kept when it is written again)
HAND_WRITTEN = "## ZeRO-2/3 with FSDP2"


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", default=str(ROOT / "schedules" / "bert-base-1f1b-4x4.yaml"), help="the run file (model, pipeline)"
    )
    parser.add_argument("--data-parallel", default="1,2,4", help="comma-separated data-parallel copies (default 1,2,4)")
    parser.add_argument(
        "--momentum", type=float, default=0.9, help="SGD momentum after K-FAC preconditioning (default 0.9)"
    )
    parser.add_argument(
        "--out",
        default=str(experiment_output("zero_memory.md")),
        help=f"Markdown file to write ('' = none; default {experiment_output('zero_memory.md')}; docs/performance.md's: docs/zero_memory.md)",
    )
    args = parser.parse_args()

    from pipefisher.config import load_config

    config = load_config(args.config)
    stages = stage_states(config)
    data_parallels = [int(item) for item in args.data_parallel.split(",")]
    header = HEADER.format(
        run=Path(args.config).name,
        stages=config.pipeline.stages,
        schedule=config.pipeline.schedule.upper(),
        micro_batch=config.data.micro_batch_size,
        seq_len=config.model.seq_len,
        momentum=f"{args.momentum:g}",
        rest=REST[config.kfac.first_order][1],
    )
    biggest = max(max(stage.parameters) for stage in stages)
    numels = ", ".join(f"{stage.numel / 1e6:.2f} M ({len(stage.curvature_layers)} K-FAC layers)" for stage in stages)
    text = "\n".join(
        [
            "# Memory and gradient traffic per rank on the data-parallel dimension",
            "",
            header,
            f"Parameters per stage: {numels}.",
            "",
            *pipefisher_table(config, stages, data_parallels, args.momentum),
            "",
            (
                f"ZeRO-1 never cuts a parameter, so no rank's share falls below the state of the largest tensor it holds: "
                f"the word embedding (stage 0) and its decoder copy (stage {len(stages) - 1}), {biggest / 1e6:.2f} M elements each "
                f"({8 * biggest / MiB:.1f} MiB of LAMB state, {4 * biggest / MiB:.1f} MiB of momentum). K-FAC's state shrinks "
                "only with gradient workers, and only by its inverses: the running factors stay on every replica."
            ),
            "",
            "## Sanity check: ZeRO's own example",
            "",
            (
                "ZeRO's accounting (Rajbhandari et al., SC'20, Figure 1: Ψ = 7.5B parameters, Nd = 64 data-parallel ranks, "
                "mixed-precision Adam: 2 bytes of fp16 parameters + 2 bytes of fp16 gradients + K = 12 bytes of fp32 optimizer "
                "state per parameter) through the same per-rank code path (one stage, 64 replicas, the parameters as 256 equal "
                "tensors). A check of the model's arithmetic, not of pipefisher's runtime, which keeps fp32 parameters and "
                "gradients. GB = 10^9 bytes."
            ),
            "",
            *deepspeed_table(),
            "",
        ]
    )
    print(text)
    if args.out:
        kept = Path(args.out).read_text().partition(HAND_WRITTEN)[2] if Path(args.out).exists() else ""
        Path(args.out).write_text(text + (f"\n{HAND_WRITTEN}{kept}" if kept else ""))


if __name__ == "__main__":
    sys.exit(entry_point(main, "zero_memory"))
