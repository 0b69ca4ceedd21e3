"""The sections of a run file that belong to no lower package (the methods', the model's, the data's
and the optimizer's live in `pipefisher.methods`, `models`, `data` and `optim`),
each key declared once: its type, default, range and one line of documentation. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipefisher.core.names import Backend, Precision
from pipefisher.core.settings import COUNT_CEILING, STEP_CEILING, setting
from pipefisher.schedules import SCHEDULES


@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline: world size = stages x data_parallel x tensor_parallel."""

    schedule: str = setting("1f1b", f"pipeline schedule: {', '.join(SCHEDULES)}")
    stages: int = setting(2, "pipeline depth D: ranks per pipeline", low=0, low_open=True, ceiling=COUNT_CEILING)
    micro_batches: int = setting(
        4, "micro-batches per step of each pipeline", low=0, low_open=True, ceiling=COUNT_CEILING
    )
    chunks: int = setting(2, "interleaved: model chunks per rank", low=0, low_open=True, ceiling=COUNT_CEILING)
    stage_blocks: tuple[int, ...] = setting(
        (),
        "blocks of each model stage in stage order (stages x chunks of them, summing to the model's blocks), e.g. "
        "[3, 1] to lighten the stage that holds the head; empty: dealt evenly",
        low=1,
    )
    data_parallel: int = setting(1, "copies of the pipeline", low=0, low_open=True, ceiling=COUNT_CEILING)
    tensor_parallel: int = setting(
        1,
        "processes each block is split over, Megatron-style (attention by heads, the MLP by its "
        "hidden features); a rank's processes share a node",
        low=0,
        low_open=True,
        ceiling=COUNT_CEILING,
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints, also written when a signal stops the run."""

    dir: str = setting("", 'folder of the checkpoints ("" = none)')
    every: int = setting(0, "steps between checkpoints (0 = only at the end)", low=0, ceiling=STEP_CEILING)
    keep: int = setting(2, "newest complete checkpoints kept", low=1)
    resume: Literal["never", "auto", "always"] = setting(
        "never",
        "never: start at step 0; auto: continue from the newest checkpoint that verifies, if any; always: require one",
    )


@dataclass(frozen=True)
class CommConfig:
    """Gradient compression over the data-parallel dimension."""

    powersgd_rank: int = setting(
        0, "rank r of PowerSGD for each replicated stage's gradient reduction (0 = off)", low=0
    )
    powersgd_start_step: int = setting(
        0, "first step (0-based) that compresses; earlier ones reduce uncompressed", low=0, ceiling=STEP_CEILING
    )


@dataclass(frozen=True)
class RunSettings:
    """How the run is carried out."""

    steps: int = setting(3, "steps of the whole run", low=0, low_open=True, ceiling=STEP_CEILING)
    seed: int = setting(0, "seed of the model's initialisation")
    backend: Backend = setting("auto", "torch.distributed backend (auto: nccl on GPUs, gloo on CPUs)")
    master_addr: str = setting("127.0.0.1", "address of rank 0 for local launches")
    master_port: int = setting(
        0,
        "port of the local launcher's rendezvous store (0: a free one, bound at once, so runs on one host "
        "never collide)",
        low=0,
        high=65535,
    )
    timeout: float = setting(60.0, "seconds any rank may wait for another before the run aborts", low=0, low_open=True)
    time_budget_s: float = setting(
        0.0,
        "seconds of training after which the run ends (0 = none: run.steps): every rank stops after the same step, "
        "the first to pass it (train_s, evaluation not counted; a resumed run's count starts anew), "
        "evaluated and checkpointed as the last; the learning-rate schedule still spans run.steps",
        low=0,
    )
    eval_every: int = setting(
        0,
        "steps between held-out evaluations, and one after the last step (0 = none); needs a held-out split (data.holdout > 0)",
        low=0,
        ceiling=STEP_CEILING,
    )
    eval_batches: int = setting(
        8,
        "held-out micro-batches per evaluation, over all data-parallel replicas (a multiple of pipeline.data_parallel)",
        low=0,
        low_open=True,
        ceiling=COUNT_CEILING,
    )
    metrics: str = setting("", 'file that gets one JSON line per step ("" = none)')
    tensorboard: str = setting(
        "", 'folder for TensorBoard event files of the step records ("" = none; needs pipefisher[log])'
    )
    wandb: str = setting("", 'Weights & Biases project that gets the step records ("" = none; needs pipefisher[log])')
    wandb_mode: Literal["online", "offline", "disabled"] = setting(
        "offline", "Weights & Biases: online (uploads), offline (a local run folder, `wandb sync` later) or disabled"
    )
    precision: Precision = setting(
        "fp32", "fp32, or bf16/fp16 autocast with fp32 master weights, optimizer and curvature state"
    )
    tf32: bool = setting(
        False,
        "CUDA: float32 matrix products on TF32 tensor cores (10-bit mantissas, float32 sums; 7x the float32 "
        "peak on an H100): the curvature methods' float32 work (factors, preconditioning, orthogonalisation, "
        "rotations) and fp32 runs' blocks; float64 work unchanged; no effect on a CPU",
    )
    loss_scale: float = setting(
        65536.0, "fp16: initial loss scale (halved on overflow, doubled after 2000 clean steps)", low=0, low_open=True
    )
    bucket_mb: float = setting(25.0, "size of the gradient all-reduce buckets, MiB", low=0, low_open=True)
    in_order: bool = setting(False, "hold every process group to NCCL's in-order rule (a test mode for gloo)")
    trace: str = setting(
        "",
        'folder for one PyTorch profiler trace per rank (rank<R>.json, Chrome/Perfetto format) of the traced steps ("" = none)',
    )
    trace_from: int = setting(
        3, "first traced step, 1-based (the steps before it warm up)", low=1, ceiling=STEP_CEILING
    )
    trace_steps: int = setting(2, "how many steps the trace covers", low=1, ceiling=STEP_CEILING)
    compile: bool = setting(
        False,
        "compile each stage's repeated blocks with torch.compile (pipelined runs; the reference stays "
        "eager); refused by methods that capture with hooks and by the zero-bubble schedules (zb-h1, zbv, dualpipev)",
    )
