"""The per-rank memory model (`pipefisher.planning.memory.peak`) against the bytes of live tensors
at the peak of a real run: the bridge from a run file to the model's inputs (`model_shape`,
`stage_states`, `predict`) and the measuring worker (`measure`), one process per rank.

The probe (`LiveTensorBytes`) watches the steps of `measured_steps`: a first-order run's second
step (the optimizer's state exists by then); a curvature run's second refresh cycle, k steps
(its state, captures held across steps, and the refresh's temporaries all inside). A curvature
run packs its plan from the profile file its section names (`<method>.profile`), and so does
`predict`: the same deterministic packer on the same profile gives the plan the run executes."""

from __future__ import annotations

import dataclasses
import math

import torch

from pipefisher.config import RunConfig
from pipefisher.core.topology import Topology
from pipefisher.data.settings import max_predictions
from pipefisher.planning.memory.activations import ModelShape
from pipefisher.core.profile import Profile, load_profile
from pipefisher.methods.registry import method_of
from pipefisher.models.kind import load
from pipefisher.models.registry import kinds, model_kind
from pipefisher.planning.packing.step_end import has_p_ops
from pipefisher.planning.planner.layer_models import LayerSettings, layer_memory_model, layer_settings, step_momentum
from pipefisher.planning.memory.layer_model import CurvatureLayer
from pipefisher.planning.memory.state import StageState, optimizer_state
from pipefisher.planning.memory.peak import RankPeak, peak_memory
from pipefisher.planning.plan import Plan
from pipefisher.runtime.training.assembly import RunParts, build_run, build_schedule
from pipefisher.runtime.training.memory_probe import LiveTensorBytes


def model_shape(config: RunConfig, model) -> ModelShape:
    """The run's model as the activation model takes it (`model`: its `staged_model`), by its
    kind's `activation_shape` (`pipefisher.models.registry`); ValueError naming model.kind for a
    model the activation model does not cover."""
    kind = model_kind(config.model.kind)
    if not kind.activation_shape:
        covered = ", ".join(name for name, other in kinds().items() if other.activation_shape)
        raise ValueError(f"model.kind: the activation model covers {covered}, not {kind.name}")
    shape = load(kind.activation_shape)(config, model)
    return dataclasses.replace(shape, stage_blocks=config.pipeline.stage_blocks)


def bert_shape(config: RunConfig, model) -> ModelShape:
    """The activation shape of model.kind bert: its BERT config's sizes."""
    bert = model.config
    return ModelShape(
        "bert",
        bert.num_hidden_layers,
        bert.hidden_size,
        bert.num_attention_heads,
        bert.intermediate_size,
        bert.vocab_size,
        config.model.seq_len,
        dropout=bert.hidden_dropout_prob,
        predictions=max_predictions(config.model.seq_len, config.data.mask_prob)
        if config.data.kind in ("bert", "shards")
        else 0,
    )


def transformer_shape(config: RunConfig, model) -> ModelShape:
    """The activation shape of model.kind transformer: its run-file keys."""
    settings = config.model
    return ModelShape(
        "tiny",
        settings.layers,
        settings.hidden,
        settings.heads,
        settings.ffn,
        0,
        settings.seq_len,
        inputs=settings.input_dim,
        outputs=settings.output_dim,
    )


def hf_shape(config: RunConfig, model) -> ModelShape:
    """The activation shape of model.kind hf: GPT-2 and Llama-like configs (ValueError otherwise)."""
    hf, seq_len = model.config, config.model.seq_len
    if hf.model_type == "gpt2":
        return ModelShape("gpt2", hf.n_layer, hf.n_embd, hf.n_head, hf.n_inner or 4 * hf.n_embd, hf.vocab_size, seq_len)
    if hf.model_type != "llama":
        raise ValueError(f"model.kind: the activation model covers hf gpt2 and llama models, not {hf.model_type}")
    return ModelShape(
        "llama",
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.intermediate_size,
        hf.vocab_size,
        seq_len,
        kv_heads=hf.num_key_value_heads,
    )


def _curvature_layers(
    config: RunConfig, model, module, settings: LayerSettings
) -> tuple[tuple[CurvatureLayer, ...], set[int]]:
    """The curvature method's memory model of each layer it works on in stage `module` at
    `settings` (`layer_settings`), and the ids of the parameters it preconditions; nothing for a
    first-order run."""
    if config.curvature is None:
        return (), set()
    method = method_of(config)
    parts, layer_model = method.runtime_parts(), layer_memory_model(method.name)
    skip = parts.skip(model)
    named = dict(module.named_parameters())
    layers = [
        layer_model.from_linear(name, *_layer_sizes(module, named, name), **dict(settings))
        for name in parts.layer_names(module, skip)
    ]
    return tuple(layers), {id(named[name]) for name in parts.preconditioned(config, module, skip)}


def _layer_sizes(module, named: dict, name: str) -> tuple[int, int, bool]:
    """(inputs, outputs, whether it has a bias) of the layer `name` a method works on: a matrix
    method's parameter (its rows x the product of the rest, `MatrixInfo`), or a layer method's
    module (a Linear, or its weight's first two dimensions)."""
    if name in named:
        shape = named[name].shape
        return math.prod(shape[1:]), shape[0], False
    layer = module.get_submodule(name)
    inputs, outputs = (
        (layer.in_features, layer.out_features) if isinstance(layer, torch.nn.Linear) else tuple(layer.weight.shape)
    )
    return inputs, outputs, getattr(layer, "bias", None) is not None


def stage_states(config: RunConfig, model, settings: LayerSettings = ()) -> list[StageState]:
    """Every stage's parameters, read off the real stages, with the curvature method's layers (at
    `settings`) and the parameters it preconditions (curvature runs), and the element counts of
    its repeated blocks (`repeated_blocks`: FSDP2's units under ZeRO-3, `fsdp_wrap`)."""
    from pipefisher.runtime.gradient_path.buffers import unique_parameters
    from pipefisher.runtime.pipeline.compiled import repeated_blocks

    num_stages = build_schedule(config).num_stages
    states = []
    for index in range(num_stages):
        module = model.build_stage(index, num_stages, config.run.seed)
        parameters = unique_parameters(module)
        layers, preconditioned = _curvature_layers(config, model, module, settings)
        states.append(
            StageState(
                tuple(p.numel() for p in parameters),
                layers,
                tuple(tuple(p.shape) for p in parameters),
                tuple(id(p) in preconditioned for p in parameters) if layers else (),
                tuple(sum(p.numel() for p in unique_parameters(block)) for block in repeated_blocks(module)),
            )
        )
    return states


def _curvature_run(config: RunConfig, run: RunParts | None = None) -> tuple[Profile, Plan]:
    """The profile a curvature run packs from (its section's file) and the plan it executes
    (`run`: the run's parts, if built)."""
    from pipefisher.runtime.training.pipefisher_run import make_plan
    from pipefisher.runtime.training.run_profile import run_profile

    run = run if run is not None else build_run(config)
    schedule = run.schedule
    section = config.method_section
    if not section.profile:
        raise ValueError(
            f"{method_of(config).name}.profile: the check packs the run's plan from a profile file; "
            "measure one with `pipefisher profile RUN.yaml -o FILE` and name it there"
        )
    profile = run_profile(load_profile(section.profile), config, schedule.num_stages, run.model)
    return profile, make_plan(config, schedule, profile, run.model).plan


def measured_steps(config: RunConfig) -> tuple[int, int]:
    """(first, last): the probe starts at the end of step `first` and stops at the end of step
    `last` (1-based): step 2 of a first-order run, the second refresh cycle of a curvature run."""
    if config.curvature is None:
        return 1, 2
    k = _curvature_run(config)[1].refresh_steps
    return k, 2 * k


def predict(config: RunConfig) -> list[RankPeak]:
    """The memory model's peak per rank for a run file (a curvature run's section names its profile)."""
    run = build_run(config)
    model = run.model
    topology = Topology(run.schedule, config.pipeline.data_parallel, config.pipeline.tensor_parallel)
    section, profile, plan = config.curvature, None, None
    settings: LayerSettings = ()
    if section is None:
        optimizer = optimizer_state(config.optimizer.name, getattr(config.optimizer, "momentum", 0.0))
    else:
        optimizer = optimizer_state(
            config.optimizer.name,
            step_momentum(config.optimizer.name, config.optimizer_settings.momentum),
            first_order=section.first_order,
            memory=method_of(config).memory,
        )
        profile, plan = _curvature_run(config, run)
        settings = layer_settings(method_of(config).name, section, has_p_ops(plan))
    return peak_memory(
        topology,
        stage_states(config, model, settings),
        optimizer,
        model_shape(config, model),
        config.data.micro_batch_size,
        config.run.precision,
        getattr(config.model, "recompute", "none"),
        config.optimizer.zero,
        workers_per_layer=config.workers_per_layer,
        powersgd_rank=config.comm.powersgd_rank,
        plan=plan,
        profile=profile,
    )


def measure(rank: int, world: int, config: RunConfig, steps: tuple[int, int] = (1, 2)) -> int:
    """Peak bytes of live tensors on this rank from the end of step `steps[0]` to the end of step
    `steps[1]` (`measured_steps`; a `run_group` worker)."""
    from pipefisher.runtime.training.trainer import build_executor, train_pipelined

    device = torch.device("cpu")
    run = build_run(config)
    executor, _ = build_executor(config, rank, device, run)
    probe = LiveTensorBytes()
    first, last = steps

    def on_step(result) -> None:
        if result.step == first:
            probe.census()
            probe.__enter__()
        elif result.step == last:
            probe.__exit__(None, None, None)

    train_pipelined(
        dataclasses.replace(config, run=dataclasses.replace(config.run, steps=last)),
        rank,
        device,
        on_step,
        executor,
        run=run,
    )
    return probe.peak
