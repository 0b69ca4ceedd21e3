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
from pipefisher.core.settings import ConfigError
from pipefisher.methods.registry import methods
from pipefisher.methods.settings import RefreshConfig
from pipefisher.schedules import CONFIGURABLE_CHUNKS, SCHEDULES, chunks_per_rank


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
    """`name`: a first-order optimizer (sgd, adamw, lamb) or a curvature method
    (`pipefisher.methods.registry`: kfac, shampoo, ...): its preconditioning, then SGD (lr,
    momentum, weight decay), with the settings of the run file's section of that name.
    `zero` 1 shards the optimizer state over each stage's replicas (ZeRO stage 1: every parameter
    has one owner, which alone receives its reduced gradient, updates it and broadcasts it; the
    optimizer state per rank falls as 1/replicas). `clip_norm` > 0 clips the global gradient
    norm (after preconditioning); the learning rate
    warms up linearly over `warmup_steps`, then stays (`constant`) or falls to 0 at step
    `decay_steps` (`linear`; 0 = the run's last step — fix it when a run is split by --resume
    into parts with other --steps). Weight decay skips biases and LayerNorm weights."""

    name: str = "sgd"
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
    #: (name, section) of every registered curvature method, each a run-file section of its name
    methods: tuple[tuple[str, RefreshConfig], ...] = field(default_factory=lambda: default_method_sections())
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    run: RunSettings = field(default_factory=RunSettings)

    @property
    def world_size(self) -> int:
        return self.pipeline.stages * self.pipeline.data_parallel

    def __getattr__(self, name: str) -> RefreshConfig:
        """A curvature method's section by its name: ``config.kfac``, ``config.shampoo``."""
        if not name.startswith("_"):
            for method, section in self.__dict__.get("methods", ()):
                if method == name:
                    return section
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def section(self, method: str) -> RefreshConfig:
        """The section of curvature method `method` (KeyError for an unknown one)."""
        return dict(self.methods)[method]

    @property
    def curvature(self) -> RefreshConfig | None:
        """The section of the run's curvature method, None for first-order runs."""
        return dict(self.methods).get(self.optimizer.name)

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
    def stage_replicas(self) -> int:
        """Copies of every stage: its pipes (Chimera has two) x the data-parallel copies."""
        return stage_replica_count(self)

    @property
    def workers_per_layer(self) -> int | None:
        """Gradient workers per layer (`pipefisher.planning.layouts.kaisa`) when the run's curvature
        method keeps each layer's refresh results on fewer than a stage's replicas; None: every replica."""
        replicas = stage_replica_count(self)
        workers = self.curvature.gradient_workers(replicas) if self.curvature is not None else replicas
        return workers if workers < replicas else None

    @property
    def model_chunks(self) -> int:
        """Model pieces per pipe: stages × the schedule's chunks per rank (`chunks_per_rank`:
        pipeline.chunks for interleaved, 2 for zbv and dualpipev, 1 otherwise)."""
        return self.pipeline.stages * chunks_per_rank(self.pipeline.schedule, self.pipeline.chunks)

    def with_overrides(self, **sections: dict[str, Any]) -> "RunConfig":
        """A copy with some keys of some sections replaced (None values are ignored), checked."""
        data = config_to_dict(self)
        for section, values in sections.items():
            data[section].update({k: v for k, v in values.items() if v is not None})
        return config_from_dict(data)


_POSITIVE = {
    "model.layers", "model.hidden", "model.heads", "model.ffn", "model.seq_len", "model.input_dim",
    "model.output_dim", "data.micro_batch_size", "data.vocab_size", "pipeline.stages", "pipeline.micro_batches",
    "pipeline.chunks", "pipeline.data_parallel", "optimizer.lr", "run.steps", "run.timeout", "optimizer.eps",
    "run.loss_scale", "run.bucket_mb",
}
FIRST_ORDER = ("sgd", "adamw", "lamb")


def default_method_sections() -> tuple[tuple[str, RefreshConfig], ...]:
    """Every registered method's section with its defaults."""
    return tuple((name, method.settings()) for name, method in methods().items())


def config_to_dict(config: RunConfig) -> dict[str, dict[str, Any]]:
    """The run as its run file has it: {section: {key: value}}, each method's section under its name."""
    data = {f.name: dataclasses.asdict(getattr(config, f.name)) for f in fields(config) if f.name != "methods"}
    data.update({name: dataclasses.asdict(section) for name, section in config.methods})
    return data


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
    fixed = [f.name for f in fields(RunConfig) if f.name != "methods"]
    known = methods()
    sections = fixed[:4] + list(known) + fixed[4:]
    if not isinstance(data, dict):
        raise ConfigError(f"the run file must be a mapping with sections {', '.join(sections)}")
    hints = typing.get_type_hints(RunConfig)
    for key in data:
        if key not in sections:
            raise ConfigError(f"{key}: unknown section; allowed sections: {', '.join(sections)}")
    config = RunConfig(**{name: _section(hints[name], data.get(name), name) for name in fixed},
                       methods=tuple((name, _section(method.settings, data.get(name), name)) for name, method in known.items()))
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
    names = FIRST_ORDER + tuple(name for name, _ in config.methods)
    if config.optimizer.name not in names:
        raise ConfigError(f"optimizer.name: {config.optimizer.name!r} is not one of {', '.join(names)}")
    if model.kind == "transformer" and model.hidden % model.heads:
        raise ConfigError(f"model.heads: {model.heads} does not divide model.hidden {model.hidden}")
    if config.optimizer.zero not in (0, 1):
        raise ConfigError(f"optimizer.zero: {config.optimizer.zero} is not a ZeRO stage pipefisher has; use 0 (off) or 1 "
                          "(optimizer state sharded over each stage's replicas)")
    comm = config.comm
    if comm.powersgd_rank < 0 or comm.powersgd_start_step < 0:
        raise ConfigError("comm.powersgd_rank and comm.powersgd_start_step must be >= 0 (powersgd_rank 0 = no compression)")
    if comm.powersgd_rank and config.optimizer.zero:
        raise ConfigError("comm.powersgd_rank: PowerSGD all-reduces its factors, ZeRO-1 reduces to owners; "
                          "use one of them (comm.powersgd_rank 0 or optimizer.zero 0)")
    for name, section in config.methods:
        section.check(name, config)
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


def load_config(path: str | Path) -> RunConfig:
    """Read a YAML run file."""
    return load_structured(path, "run file", config_from_dict, ConfigError)


__all__ = [
    "ConfigError",
    "CheckpointConfig",
    "DataConfig",
    "ModelConfig",
    "RefreshConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "RunConfig",
    "RunSettings",
    "config_to_dict",
    "config_from_dict",
    "load_config",
]
