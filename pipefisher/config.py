"""Run configuration: YAML -> frozen dataclasses. Unknown keys and bad values are errors that name
the key and what is allowed. Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from pipefisher.core.files import load_structured
from pipefisher.planning.layouts.kaisa import worker_count
from pipefisher.schedules import CONFIGURABLE_CHUNKS, SCHEDULES, chunks_per_rank


class ConfigError(ValueError):
    """A run file is malformed; the message names the key (e.g. ``pipeline.stages``)."""


@dataclass(frozen=True)
class ModelConfig:
    """`bert`: BERT pretraining (MLM + NSP) from a preset (bert-tiny, bert-mini, bert-base,
    bert-large) or a Hugging Face config.json (`config_json`); its vocabulary follows the data's
    tokenizer; `dropout` >= 0 overrides the config's dropout probabilities.
    `hf`: a Hugging Face Transformers model (the `hf` extra) of class `hf_class` ("" = the config's
    first `architectures` entry) built from `hf_config` (a config.json path, or a config shipped
    with pipefisher: gpt2-tiny, bert-tiny, llama-tiny, gpt2-medium), its vocabulary following the
    data's tokenizer, or loaded from the safetensors file `hf_weights`.
    `transformer`/`mlp`: a small regression model on continuous inputs (micro_batch_size,
    seq_len, input_dim) -> (…, output_dim); `layers` counts its blocks. `seq_len`: tokens per
    sequence for every kind.
    """

    kind: Literal["transformer", "mlp", "bert", "hf"] = "transformer"
    preset: str = "bert-tiny"
    config_json: str = ""
    hf_config: str = "gpt2-tiny"
    hf_class: str = ""
    hf_weights: str = ""
    dropout: float = -1.0
    layers: int = 4
    hidden: int = 32
    heads: int = 2
    ffn: int = 64
    seq_len: int = 8
    input_dim: int = 16
    output_dim: int = 4


@dataclass(frozen=True)
class DataConfig:
    """Micro-batches, deterministic in (seed, step, micro-batch). `synthetic`: regression data
    for the transformer/mlp models. `bert`: sentence pairs with 15 % masking from `corpus`
    ("embedded" = English text shipped with Python, or a file: one sentence per line, blank line
    between documents) tokenised by WordPiece (`vocab`: a BERT vocab.txt, "" = train one of
    `vocab_size` on the corpus). `causal`: next-token prediction on `corpus` packed into
    sequences of model.seq_len tokens, tokenised by byte-level BPE (`tokenizer`: a tokenizer.json,
    "" = train one of `vocab_size` on the corpus). Tokenizers and tokens are cached in `cache_dir`
    ("" = default)."""

    kind: Literal["synthetic", "bert", "causal"] = "synthetic"
    seed: int = 0
    micro_batch_size: int = 4
    corpus: str = "embedded"
    vocab: str = ""
    tokenizer: str = ""
    vocab_size: int = 4000
    mask_prob: float = 0.15
    cache_dir: str = ""


@dataclass(frozen=True)
class PipelineConfig:
    """`stages` = pipeline depth D (ranks per pipeline); world size = stages × data_parallel."""

    schedule: str = "1f1b"
    stages: int = 2
    micro_batches: int = 4
    chunks: int = 2
    data_parallel: int = 1


@dataclass(frozen=True)
class OptimizerConfig:
    """`kfac`: K-FAC preconditioning of every Linear layer, then SGD (lr, momentum, weight decay);
    `shampoo`: Shampoo preconditioning with grafting of every parameter, then SGD likewise.
    `zero` 1 shards the optimizer state over each stage's replicas (ZeRO stage 1: every parameter
    has one owner, which alone receives its reduced gradient, updates it and broadcasts it; the
    optimizer state per rank falls as 1/replicas). `clip_norm` > 0 clips the global gradient
    norm (after preconditioning); the learning rate
    warms up linearly over `warmup_steps`, then stays (`constant`) or falls to 0 at step
    `decay_steps` (`linear`; 0 = the run's last step — fix it when a run is split by --resume
    into parts with other --steps). Weight decay skips biases and LayerNorm weights."""

    name: Literal["sgd", "adamw", "lamb", "kfac", "shampoo"] = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_norm: float = 0.0
    warmup_steps: int = 0
    decay: Literal["constant", "linear"] = "constant"
    decay_steps: int = 0
    zero: int = 0


@dataclass(frozen=True)
class RefreshConfig:
    """How a curvature method's refresh work is placed; the keys the kfac and shampoo sections
    share. `lr` and `momentum`: of the SGD step after preconditioning (0 = optimizer.lr /
    optimizer.momentum), so a run file can carry the method's tuned values beside another
    optimizer's.

    `refresh_steps` 0 lets the packer choose k (at most `max_refresh_steps`, 0 = no cap; see
    `pipefisher.planning.packing.pack` for the rule), packing with the `percentile` of the profile's measured
    samples, `margin` of each bubble kept free, within `max_overhead` (a share of the step), holding
    at most `max_capture_mb` MiB of captures per device (0 = no cap); `placement` packed puts the
    work in the bubbles, after-step runs it in one block after the first step of each cycle;
    `split` spreads the refresh work of a stage over its pipes' replicas and exchanges the results.
    `profile`: a pipefisher.profile/v1 file of this run ("" = measure one before training).
    `plan`: a pipefisher.plan/v1 file of this run (`pipefisher pack -o`) to run as it is instead
    of packing ("" = pack); the profile then only predicts its times.
    Re-profiling: when the measured cycle time differs from the prediction by more than
    `reprofile_threshold` (a share) for `reprofile_patience` cycles in a row, the run measures
    again and re-packs (a steady gap right after a fresh measurement counts as the simulator's
    error, not as drift).
    """

    lr: float = 0.0
    momentum: float = 0.0
    refresh_steps: int = 0
    placement: Literal["packed", "after-step"] = "packed"
    margin: float = 0.0
    percentile: float = 90.0
    max_overhead: float = 0.01
    max_refresh_steps: int = 0
    max_capture_mb: float = 0.0
    split: bool = True
    profile: str = ""
    plan: str = ""
    reprofile_threshold: float = 0.25
    reprofile_patience: int = 3


@dataclass(frozen=True)
class KfacConfig(RefreshConfig):
    """K-FAC settings (used with optimizer.name kfac): damping, factor EMA decay, inverse method;
    `grad_worker_fraction` f (KAISA, `pipefisher.planning.layouts.kaisa`): each layer's inverses live on f of a
    stage's replicas, which precondition its reduced gradient and broadcast it to the others
    (1 = every replica keeps every inverse and preconditions before the reduction); placement
    keys as `RefreshConfig`."""

    damping: float = 1e-3
    factor_decay: float = 0.95
    inverse: Literal["eigen", "cholesky"] = "eigen"
    grad_worker_fraction: float = 1.0


@dataclass(frozen=True)
class ShampooConfig(RefreshConfig):
    """Shampoo settings (used with optimizer.name shampoo; `pipefisher.methods.shampoo`): statistics decay
    `beta2` (1 = plain sum), `epsilon` added before the inverse 4th root, `block_size` (longer
    dimensions are cut into blocks), `root` method, `grafting` (adam takes optimizer.betas[1] and
    optimizer.eps), `start_step` (steps before it use the grafting direction alone),
    `statistics_dtype` (float64: a statistic GGᵀ squares the gradient's condition number, which
    float32 resolves only to about 1e-7 of its largest eigenvalue); the statistics come from the
    gradient of every refresh cycle's first step. Placement keys as `RefreshConfig`."""

    beta2: float = 1.0
    epsilon: float = 1e-12
    block_size: int = 1024
    root: Literal["eigen", "newton"] = "eigen"
    grafting: Literal["adam", "sgd", "none"] = "adam"
    start_step: int = 0
    statistics_dtype: Literal["float64", "float32"] = "float64"


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints in `dir` ("" = none) every `every` steps (0 = only at the end), and when a
    signal stops the run; the `keep` newest are kept. `resume`: `never` starts at step 0; `auto`
    continues from the newest checkpoint that verifies when there is one (restarts under
    `torchrun --max-restarts`); `always` (`--resume`) requires one."""

    dir: str = ""
    every: int = 0
    keep: int = 2
    resume: Literal["never", "auto", "always"] = "never"


@dataclass(frozen=True)
class CommConfig:
    """Gradient compression over the data-parallel dimension: `powersgd_rank` r > 0 compresses
    each replicated stage's gradient reduction with rank-r PowerSGD (Vogels et al., NeurIPS 2019:
    error feedback, Q warm-started from the previous step; vectors, and matrices that rank r
    would not shrink, travel uncompressed), from step `powersgd_start_step` on (0-based; earlier
    steps reduce uncompressed). 0 = off."""

    powersgd_rank: int = 0
    powersgd_start_step: int = 0


@dataclass(frozen=True)
class RunSettings:
    """`timeout`: seconds any rank may wait for another before the run aborts; `metrics`: a file
    that gets one JSON line per step ("" = none). `precision`: fp32, or bf16/fp16 autocast for
    forward and backward with fp32 master weights, optimizer state and K-FAC factors (activations
    and gradients travel between stages in the compute dtype); fp16 scales the loss dynamically
    from `loss_scale` (halved on overflow, doubled after 2000 clean steps). `bucket_mb`: size of
    the gradient all-reduce buckets in MiB. `in_order`: hold every process group to NCCL's rule
    (each operation starts after the previous one on its group completed): a test mode for gloo."""

    steps: int = 3
    seed: int = 0
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    master_addr: str = "127.0.0.1"
    master_port: int = 29511
    timeout: float = 60.0
    metrics: str = ""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: float = 65536.0
    bucket_mb: float = 25.0
    in_order: bool = False


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    kfac: KfacConfig = field(default_factory=KfacConfig)
    shampoo: ShampooConfig = field(default_factory=ShampooConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    run: RunSettings = field(default_factory=RunSettings)

    @property
    def world_size(self) -> int:
        return self.pipeline.stages * self.pipeline.data_parallel

    @property
    def curvature(self) -> KfacConfig | ShampooConfig | None:
        """The section of the run's curvature method (kfac or shampoo), None for first-order runs."""
        return {"kfac": self.kfac, "shampoo": self.shampoo}.get(self.optimizer.name)

    @property
    def optimizer_settings(self) -> OptimizerConfig:
        """The optimizer section as the run uses it: with a curvature method, its section's `lr`
        and `momentum` replace lr and momentum when they are set."""
        section = self.curvature
        if section is None:
            return self.optimizer
        return dataclasses.replace(self.optimizer, lr=section.lr or self.optimizer.lr,
                                   momentum=section.momentum or self.optimizer.momentum)

    @property
    def workers_per_layer(self) -> int | None:
        """K-FAC's gradient workers per layer (`pipefisher.planning.layouts.kaisa`) when they are fewer than a
        stage's replicas (optimizer kfac, kfac.grad_worker_fraction < 1); None: every replica."""
        replicas = stage_replica_count(self)
        workers = worker_count(replicas, self.kfac.grad_worker_fraction) if self.optimizer.name == "kfac" else replicas
        return workers if workers < replicas else None

    @property
    def model_chunks(self) -> int:
        """Model pieces per pipe: stages × the schedule's chunks per rank (`chunks_per_rank`:
        pipeline.chunks for interleaved, 2 for zbv and dualpipev, 1 otherwise)."""
        return self.pipeline.stages * chunks_per_rank(self.pipeline.schedule, self.pipeline.chunks)

    def with_overrides(self, **sections: dict[str, Any]) -> "RunConfig":
        """A copy with some keys of some sections replaced (None values are ignored), checked."""
        data = dataclasses.asdict(self)
        for section, values in sections.items():
            data[section].update({k: v for k, v in values.items() if v is not None})
        return config_from_dict(data)


_POSITIVE = {
    "model.layers", "model.hidden", "model.heads", "model.ffn", "model.seq_len", "model.input_dim",
    "model.output_dim", "data.micro_batch_size", "data.vocab_size", "pipeline.stages", "pipeline.micro_batches",
    "pipeline.chunks", "pipeline.data_parallel", "optimizer.lr", "run.steps", "run.timeout", "optimizer.eps",
    "kfac.damping", "kfac.reprofile_threshold", "kfac.reprofile_patience", "run.loss_scale", "run.bucket_mb",
    "shampoo.reprofile_threshold", "shampoo.reprofile_patience", "shampoo.epsilon", "shampoo.block_size",
}


def _convert(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    if origin is tuple:
        kinds = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)) or len(value) != len(kinds):
            raise ConfigError(f"{where}: expected a list of {len(kinds)} numbers, got {value!r}")
        return tuple(_convert(v, k, f"{where}[{i}]") for i, (v, k) in enumerate(zip(value, kinds)))
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: no conversion for {annotation!r}")


def _section(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    for key in data:
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown key; allowed keys: {', '.join(known)}")
    values = {}
    for key, value in data.items():
        name = f"{where}.{key}"
        converted = _convert(value, hints[key], name)
        if name in _POSITIVE and not converted > 0:
            raise ConfigError(f"{name}: {value!r} must be positive")
        values[key] = converted
    return cls(**values)


def config_from_dict(data: Any) -> RunConfig:
    """Build and check a RunConfig (see the module docstring)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("the run file must be a mapping with sections model, data, pipeline, optimizer, kfac, shampoo, checkpoint, comm, run")
    sections = [f.name for f in fields(RunConfig)]
    hints = typing.get_type_hints(RunConfig)
    for key in data:
        if key not in sections:
            raise ConfigError(f"{key}: unknown section; allowed sections: {', '.join(sections)}")
    config = RunConfig(**{name: _section(hints[name], data.get(name), name) for name in sections})
    _check(config)
    return config


def stage_replica_count(config: RunConfig) -> int:
    """Copies of every stage: its pipes (Chimera has two) x the data-parallel copies."""
    return (2 if config.pipeline.schedule == "chimera" else 1) * config.pipeline.data_parallel


def stage_count_terms(pipeline: PipelineConfig) -> tuple[str, str]:
    """How the run's stage count per pipe is made, for messages: (its factors with their values,
    the product to fix), e.g. ("pipeline.stages 2 x pipeline.chunks 3", "pipeline.stages x
    pipeline.chunks") for interleaved, ("pipeline.stages 2 x 2 chunks per rank of zbv",
    "2 x pipeline.stages") for a V schedule, ("pipeline.stages 2", "pipeline.stages") otherwise."""
    stages = f"pipeline.stages {pipeline.stages}"
    if pipeline.schedule in CONFIGURABLE_CHUNKS:
        return f"{stages} x pipeline.chunks {pipeline.chunks}", "pipeline.stages x pipeline.chunks"
    chunks = chunks_per_rank(pipeline.schedule)
    if chunks > 1:
        return f"{stages} x {chunks} chunks per rank of {pipeline.schedule}", f"{chunks} x pipeline.stages"
    return stages, "pipeline.stages"


def split_hint(layers: int, what: str) -> str:
    """How to fix a stage count that does not divide `layers`: name the divisors."""
    divisors = [str(d) for d in range(1, layers + 1) if layers % d == 0]
    listed = divisors[0] if len(divisors) == 1 else ", ".join(divisors[:-1]) + " or " + divisors[-1]
    return f"make {what} a divisor of {layers}: {listed}"


def _check(config: RunConfig) -> None:
    pipeline, model = config.pipeline, config.model
    if pipeline.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule: {pipeline.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if model.kind in ("transformer", "mlp") and model.layers % config.model_chunks:
        factors, product = stage_count_terms(pipeline)
        raise ConfigError(
            f"model.layers: {model.layers} blocks cannot be split into {config.model_chunks} equal stages "
            f"({factors}); {split_hint(model.layers, product)}"
        )
    fits = {"transformer": ("synthetic",), "mlp": ("synthetic",), "bert": ("bert",), "hf": ("causal", "bert")}[model.kind]
    if config.data.kind not in fits:
        raise ConfigError(f"data.kind: {config.data.kind!r} does not fit model.kind {model.kind!r}; it needs data.kind "
                          + " or ".join(fits))
    if config.data.tokenizer and config.data.kind != "causal":
        raise ConfigError("data.tokenizer: a tokenizer.json is read by data.kind causal; BERT data takes a vocab.txt as data.vocab")
    if not 0 < config.data.mask_prob < 1:
        raise ConfigError(f"data.mask_prob: {config.data.mask_prob} must be in (0, 1)")
    if model.dropout != -1.0 and not 0 <= model.dropout < 1:
        raise ConfigError(f"model.dropout: {model.dropout:g} must be in [0, 1) (a probability; leave it out for the model's own)")
    _check_optimizer(config.optimizer)
    if model.kind == "transformer" and model.hidden % model.heads:
        raise ConfigError(f"model.heads: {model.heads} does not divide model.hidden {model.hidden}")
    if config.optimizer.zero not in (0, 1):
        raise ConfigError(f"optimizer.zero: {config.optimizer.zero} is not a ZeRO stage pipefisher has; use 0 (off) or 1 "
                          "(optimizer state sharded over each stage's replicas)")
    if config.optimizer.name == "kfac":
        try:
            worker_count(stage_replica_count(config), config.kfac.grad_worker_fraction)
        except ValueError as exc:
            raise ConfigError(f"kfac.grad_worker_fraction: {exc}") from None
        if config.workers_per_layer is not None and config.optimizer.zero:
            raise ConfigError("kfac.grad_worker_fraction: gradient workers need every replica's reduced gradient, ZeRO-1 "
                              "reduces to owners; use kfac.grad_worker_fraction 1 or optimizer.zero 0")
    comm = config.comm
    if comm.powersgd_rank < 0 or comm.powersgd_start_step < 0:
        raise ConfigError("comm.powersgd_rank and comm.powersgd_start_step must be >= 0 (powersgd_rank 0 = no compression)")
    if comm.powersgd_rank and config.optimizer.zero:
        raise ConfigError("comm.powersgd_rank: PowerSGD all-reduces its factors, ZeRO-1 reduces to owners; "
                          "use one of them (comm.powersgd_rank 0 or optimizer.zero 0)")
    for section in ("kfac", "shampoo"):
        _check_refresh(getattr(config, section), section)
    if not 0 <= config.kfac.factor_decay < 1:
        raise ConfigError(f"kfac.factor_decay: {config.kfac.factor_decay} must be in [0, 1)")
    shampoo = config.shampoo
    if not 0 < shampoo.beta2 <= 1:
        raise ConfigError(f"shampoo.beta2: {shampoo.beta2} must be in (0, 1] (1 = a plain sum of the statistics)")
    if shampoo.start_step < 0:
        raise ConfigError(f"shampoo.start_step: {shampoo.start_step} must be >= 0")
    if config.checkpoint.every < 0 or config.checkpoint.keep < 1:
        raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")
    if config.checkpoint.resume != "never" and not config.checkpoint.dir:
        raise ConfigError(f"checkpoint.resume: {config.checkpoint.resume!r} needs checkpoint.dir (or --checkpoint-dir)")
    if not 0 <= config.run.master_port < 65536:
        raise ConfigError(f"run.master_port: {config.run.master_port} is not a port number (0 picks a free one)")


def _check_optimizer(optimizer: OptimizerConfig) -> None:
    """The optimizer section's numbers against their ranges."""
    if not 0 <= optimizer.momentum < 1:
        raise ConfigError(f"optimizer.momentum: {optimizer.momentum:g} must be in [0, 1)")
    for index, beta in enumerate(optimizer.betas):
        if not 0 <= beta < 1:
            raise ConfigError(f"optimizer.betas[{index}]: {beta:g} must be in [0, 1)")
    for key in ("weight_decay", "clip_norm", "warmup_steps", "decay_steps"):
        if getattr(optimizer, key) < 0:
            raise ConfigError(f"optimizer.{key}: {getattr(optimizer, key):g} must be >= 0 (0 = off)")


def _check_refresh(section: RefreshConfig, name: str) -> None:
    """The placement keys of a curvature method's section `name`."""
    if section.refresh_steps < 0:
        raise ConfigError(f"{name}.refresh_steps: {section.refresh_steps} must be >= 1, or 0 to let the packer choose")
    if section.lr < 0 or not 0 <= section.momentum < 1:
        raise ConfigError(f"{name}.lr must be >= 0 (0 = optimizer.lr) and {name}.momentum in [0, 1) (0 = optimizer.momentum)")
    if not 0 <= section.margin < 1 or section.max_overhead < 0:
        raise ConfigError(f"{name}.margin must be in [0, 1) and {name}.max_overhead >= 0")
    if not 0 < section.percentile <= 100:
        raise ConfigError(f"{name}.percentile: {section.percentile:g} must be in (0, 100] (50 = the median)")
    if section.max_refresh_steps < 0 or section.max_capture_mb < 0:
        raise ConfigError(f"{name}.max_refresh_steps and {name}.max_capture_mb must be >= 0 (0 = no cap)")


def load_config(path: str | Path) -> RunConfig:
    """Read a YAML run file."""
    return load_structured(path, "run file", config_from_dict, ConfigError)


__all__ = [
    "ConfigError",
    "CheckpointConfig",
    "DataConfig",
    "KfacConfig",
    "ModelConfig",
    "RefreshConfig",
    "ShampooConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "RunConfig",
    "RunSettings",
    "config_from_dict",
    "load_config",
]
