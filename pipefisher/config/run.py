"""The run: a run file (YAML) -> `RunConfig`, frozen dataclasses of its sections
(`pipefisher.config.sections`, one per curvature method from the registry). Unknown keys and bad
values are errors that name the key and what is allowed: each key's type and range come from its
declaration (`pipefisher.core.settings.setting`), the rules between keys are `_check`'s. Pure
Python: no torch.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from pipefisher.config.applies import check_applies
from pipefisher.config.sharding import fsdp_problem
from pipefisher.config.stage_split import check_stage_blocks, split_hint, stage_count_terms
from pipefisher.core.files import load_structured
from pipefisher.core.ir import ScheduleError
from pipefisher.core.names import FIRST_ORDER
from pipefisher.config.sections import CheckpointConfig, CommConfig, PipelineConfig, RunSettings
from pipefisher.core.settings import ConfigError, check_ranges, closest, type_name
from pipefisher.data.settings import DataConfig, has_held_out_split
from pipefisher.methods.registry import methods
from pipefisher.methods.settings import RefreshConfig
from pipefisher.models.registry import kinds, model_kind
from pipefisher.models.settings import ModelConfig
from pipefisher.optim.settings import OptimizerConfig
from pipefisher.planning.comm.actions import ZERO_REDUCTIONS, GradientPath, Reduction
from pipefisher.schedules import SCHEDULES, chunks_per_rank, get_schedule


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
        return self.pipeline.stages * self.pipeline.data_parallel * self.pipeline.tensor_parallel

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
    def method_section(self) -> RefreshConfig:
        """`curvature` of a curvature run; ConfigError naming optimizer.name otherwise."""
        section = self.curvature
        if section is None:
            raise ConfigError(f"optimizer.name: {self.optimizer.name} is not a curvature method")
        return section

    @property
    def optimizer_settings(self) -> OptimizerConfig:
        """The optimizer section as the run uses it: with a curvature method, its section's `lr`
        and `momentum` replace lr and momentum when they are set."""
        section = self.curvature
        if section is None:
            return self.optimizer
        return dataclasses.replace(
            self.optimizer, lr=section.lr or self.optimizer.lr, momentum=section.momentum or self.optimizer.momentum
        )

    @property
    def rest_settings(self) -> OptimizerConfig:
        """The settings of what a curvature method leaves: its section's `first_order` rule, at the
        method's lr and momentum for sgd, else at the optimizer's (a first-order run: its optimizer)."""
        if self.curvature is None:
            return self.optimizer
        rule = self.curvature.first_order
        return dataclasses.replace(self.optimizer_settings if rule == "sgd" else self.optimizer, name=rule)

    @property
    def stage_replicas(self) -> int:
        """Copies of every stage: its pipes (Chimera has two) x the data-parallel copies."""
        return stage_replica_count(self)

    @property
    def workers_per_layer(self) -> int | None:
        """Gradient workers per layer (`pipefisher.planning.replicas.kaisa`) when the run's curvature
        method keeps each layer's refresh results on fewer than a stage's replicas; None: every replica."""
        section = self.curvature
        return None if section is None else section.workers_per_layer(self.stage_replicas, self.optimizer.zero)

    @property
    def precondition_op(self) -> bool:
        """Whether the run's stages have their method's per-step P op (`RefreshConfig.precondition_op`)."""
        return self.curvature is None or self.curvature.precondition_op(self.stage_replicas, self.optimizer.zero)

    @property
    def gradient_path(self) -> GradientPath:
        """How a replicated stage's gradient travels: optimizer.zero 1-3 or comm.powersgd_rank picks
        the reduction (not both), the method's gradient workers join it (ConfigError naming the keys
        for a combination that does not exist; the section's rules are `_check`'s)."""
        chosen = [
            reduction
            for reduction, key in (
                (ZERO_REDUCTIONS[self.optimizer.zero], self.optimizer.zero),
                (Reduction.COMPRESSED, self.comm.powersgd_rank),
            )
            if key
        ]
        if len(chosen) > 1:
            raise ConfigError(
                "comm.powersgd_rank: PowerSGD all-reduces its factors, ZeRO reduces to owners or shards; "
                "use one of them (comm.powersgd_rank 0 or optimizer.zero 0)"
            )
        # workers against the reduction: refused before, by the section's `layout_problem` (`_check`)
        return GradientPath(chosen[0] if chosen else Reduction.ALL_REDUCE, self.workers_per_layer)

    @property
    def model_chunks(self) -> int:
        """Model pieces per pipe: stages × the schedule's chunks per rank (`chunks_per_rank`:
        pipeline.chunks for interleaved, 2 for zbv and dualpipev, 1 otherwise)."""
        return self.pipeline.stages * chunks_per_rank(self.pipeline.schedule, self.pipeline.chunks)

    def with_overrides(self, **sections: dict[str, Any]) -> RunConfig:
        """A copy with some keys of some sections replaced (None values are ignored), checked."""
        data = config_to_dict(self)
        for section, values in sections.items():
            data[section].update({k: v for k, v in values.items() if v is not None})
        return config_from_dict(data)


def default_method_sections() -> tuple[tuple[str, RefreshConfig], ...]:
    """Every registered method's section with its defaults."""
    return tuple((name, method.settings()) for name, method in methods().items())


def config_to_dict(config: RunConfig) -> dict[str, dict[str, Any]]:
    """The run as its run file has it: {section: {key: value}}, each method's section under its name."""
    data = {f.name: dataclasses.asdict(getattr(config, f.name)) for f in fields(config) if f.name != "methods"}
    data.update({name: dataclasses.asdict(section) for name, section in config.methods})
    return data


def whole_number(value: Any, where: str) -> int:
    """An integer key's value: an int, or a float that is a whole number (`1e3` -> 1000, as YAML
    1.2 reads 1e3 as a float); ConfigError naming `where` otherwise (`check_ranges` bounds it)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    return value


def _convert(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    if origin is tuple and typing.get_args(annotation)[-1] is Ellipsis:
        kind = typing.get_args(annotation)[0]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list of {type_name(kind)}s, got {value!r}")
        return tuple(_convert(v, kind, f"{where}[{i}]") for i, v in enumerate(value))
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
        return whole_number(value, where)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
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
            meant = closest(str(key), known)
            raise ConfigError(
                f"{where}.{key}: unknown key; "
                + (f"did you mean {meant}?" if meant else f"allowed keys: {', '.join(known)}")
            )
    section = cls(**{key: _convert(value, hints[key], f"{where}.{key}") for key, value in data.items()})
    check_ranges(section, where)
    return section


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
            meant = closest(str(key), sections)
            raise ConfigError(
                f"{key}: unknown section; "
                + (f"did you mean {meant}?" if meant else f"allowed sections: {', '.join(sections)}")
            )
    config = RunConfig(
        **{name: _section(hints[name], data.get(name), name) for name in fixed},
        methods=tuple((name, _section(method.settings, data.get(name), name)) for name, method in known.items()),
    )
    _check(config)
    return config


def stage_replica_count(config: RunConfig) -> int:
    """Copies of every stage: its pipes (Chimera has two) x the data-parallel copies."""
    return (2 if config.pipeline.schedule == "chimera" else 1) * config.pipeline.data_parallel


def _check_helpers(config: RunConfig) -> None:
    """The curvature section's `helpers` only where its method can hand out work, on one pipeline
    of one process per rank (ConfigError naming the key otherwise)."""
    method = methods()[config.optimizer.name]
    name = config.optimizer.name
    if not method.rules.helpers:
        raise ConfigError(f"{name}.helpers: {method.label}'s per-step work cannot run on another rank; set it false")
    if config.pipeline.tensor_parallel > 1 or stage_replica_count(config) > 1:
        raise ConfigError(
            f"{name}.helpers: not with pipeline.tensor_parallel > 1, pipeline.data_parallel > 1 or chimera's two pipes "
            "(help ops pair the ranks of one pipeline, a process each); set it false"
        )


def _check(config: RunConfig) -> None:
    pipeline, model = config.pipeline, config.model
    kind = model_kind(model.kind)
    if pipeline.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule: {pipeline.schedule!r} is not one of {', '.join(SCHEDULES)}")
    blocks = getattr(model, kind.blocks_key) if kind.blocks_key else 0
    if pipeline.stage_blocks:
        check_stage_blocks(pipeline, model.kind, blocks, f"model.{kind.blocks_key}", kind.uneven_splits)
    elif blocks % config.model_chunks:
        factors, product = stage_count_terms(pipeline)
        raise ConfigError(
            f"model.{kind.blocks_key}: {blocks} blocks cannot be split into {config.model_chunks} equal stages "
            f"({factors}); {split_hint(blocks, product)}"
        )
    shards = config.data.kind == "shards"
    if shards and not config.data.shards:
        raise ConfigError(
            "data.shards: data.kind shards reads a prepared folder; give it (`pipefisher data prepare` makes one)"
        )
    if config.data.kind not in kind.data and not (shards and {"bert", "causal"} & set(kind.data)):
        raise ConfigError(
            f"data.kind: {config.data.kind!r} does not fit model.kind {model.kind!r}; it needs data.kind "
            + " or ".join(kind.data)
        )
    if config.data.tokenizer and config.data.kind != "causal":
        raise ConfigError(
            "data.tokenizer: a tokenizer.json is read by data.kind causal; BERT data takes a vocab.txt as data.vocab"
        )
    names = FIRST_ORDER + tuple(name for name, _ in config.methods)
    if config.optimizer.name not in names:
        raise ConfigError(f"optimizer.name: {config.optimizer.name!r} is not one of {', '.join(names)}")
    problem = kind.check(model)
    if problem:
        raise ConfigError(problem)
    problem = fsdp_problem(config.optimizer, pipeline, config.run, methods().get(config.optimizer.name))
    if problem:
        raise ConfigError(problem)
    for name, section in config.methods:
        section.check(name, config)
    if config.curvature is not None:
        problem = config.curvature.layout_problem(config.optimizer.name, config.optimizer.zero, config.stage_replicas)
        if problem:
            raise ConfigError(problem)
        if config.curvature.helpers:
            _check_helpers(config)
    _ = config.gradient_path  # raises ConfigError unless the reduction and gradient workers combine
    _check_evaluation(config)
    if config.checkpoint.resume != "never" and not config.checkpoint.dir:
        raise ConfigError(f"checkpoint.resume: {config.checkpoint.resume!r} needs checkpoint.dir (or --checkpoint-dir)")
    if pipeline.tensor_parallel > 1:
        _check_tensor_parallel(config)
    problem = recompute_problem(model.recompute, pipeline.schedule, _splits_backward(pipeline))
    if problem:
        raise ConfigError(f"model.recompute: {problem}")
    if config.run.compile and _splits_backward(pipeline):
        raise ConfigError(
            f"run.compile: {pipeline.schedule} splits each block's backward into input and weight gradients, "
            "which a compiled block computes in one piece; set run.compile false or use pipeline.schedule 1f1b"
        )
    check_applies(config)  # last: what cannot run at all is said first, then what would be ignored


def _check_evaluation(config: RunConfig) -> None:
    """Held-out evaluation (`run.eval_every`) needs a held-out split, and its micro-batches split
    evenly over the data-parallel replicas."""
    run, replicas = config.run, config.pipeline.data_parallel
    if not run.eval_every:
        return
    if not has_held_out_split(config.data):
        raise ConfigError(
            f"run.eval_every: {run.eval_every} evaluates on held-out data, which this run's data ({config.data.kind}) "
            "does not have; set data.holdout > 0 with data.kind bert or causal, use data.kind shards (their valid split), "
            "or set run.eval_every 0"
        )
    if run.eval_batches % replicas:
        raise ConfigError(
            f"run.eval_batches: {run.eval_batches} micro-batches do not split evenly over pipeline.data_parallel "
            f"{replicas} replicas; use a multiple of {replicas}"
        )


def _check_tensor_parallel(config: RunConfig) -> None:
    """The rules of pipeline.tensor_parallel T > 1 that the run file alone decides (the widths a
    model reads from elsewhere, e.g. bert and hf configs, are checked when the model is built)."""
    model, degree = config.model, config.pipeline.tensor_parallel
    kind = model_kind(model.kind)
    if not kind.tensor_parallel:
        splittable = ", ".join(name for name, other in kinds().items() if other.tensor_parallel)
        raise ConfigError(
            f"pipeline.tensor_parallel: model.kind {kind.name} has no tensor-parallel split; use model.kind "
            f"{splittable}, or pipeline.tensor_parallel 1"
        )
    for name in kind.tensor_parallel_divides:
        value = getattr(model, name)
        if value % degree:
            raise ConfigError(
                f"pipeline.tensor_parallel: {degree} does not divide model.{name} {value}; make it a divisor of {value}"
            )
    if config.run.compile:
        raise ConfigError(
            "run.compile: tensor-parallel blocks call collectives inside forward and backward, which "
            "compiled blocks do not; set run.compile false or pipeline.tensor_parallel 1"
        )


def recompute_problem(recompute: str, schedule: str, splits_backward: bool) -> str:
    """Why `model.recompute` cannot run under this schedule, with the fix ("" when it can);
    `splits_backward`: the schedule splits backwards (zero-bubble ones). Tensor parallelism
    composes: a recomputed block's all-reduces run again inside its backward op, on every shard
    in the same order (`pipefisher.planning.comm.processes`)."""
    if recompute == "blocks" and splits_backward:
        return (
            f"blocks under {schedule}, whose split backward recomputes each block again for every weight-gradient pass "
            "(9 times instead of once on the regression model); use model.recompute selective or pipeline.schedule 1f1b"
        )
    return ""


def _splits_backward(pipeline: PipelineConfig) -> bool:
    """Whether the run's schedule splits its backwards (zero-bubble schedules); False for a
    schedule that cannot be built, whose error comes where the run builds it."""
    try:
        chunks = chunks_per_rank(pipeline.schedule, pipeline.chunks)
        return get_schedule(pipeline.schedule, pipeline.stages, pipeline.micro_batches, chunks).splits_backward
    except ScheduleError:
        return False


def load_config(path: str | Path) -> RunConfig:
    """Read a YAML run file."""
    return load_structured(path, "run file", config_from_dict, ConfigError)
