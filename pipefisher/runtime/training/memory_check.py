"""The per-rank memory model (`pipefisher.planning.peak_memory`) against the bytes of live tensors
at the peak of a real run: the bridge from a run file to the model's inputs (`model_shape`,
`stage_states`, `predict`) and the measuring worker (`measure`), one process per rank.

A run trains `run.steps` steps (at least 2); the probe (`LiveTensorBytes`) starts at the end of
the first step, once the optimizer's state exists, and watches the second."""

from __future__ import annotations

import dataclasses

import torch

from pipefisher.config import RunConfig
from pipefisher.core.topology import Topology
from pipefisher.planning.activation_memory import ModelShape
from pipefisher.planning.memory import StageState, optimizer_state
from pipefisher.planning.peak_memory import RankPeak, peak_memory
from pipefisher.runtime.training.assembly import build_schedule, staged_model
from pipefisher.runtime.training.memory_probe import LiveTensorBytes


def model_shape(config: RunConfig, model) -> ModelShape:
    """The run's model as the activation model takes it (`model`: its `staged_model`)."""
    settings = config.model
    if settings.kind == "bert":
        bert = model.config
        return ModelShape("bert", bert.num_hidden_layers, bert.hidden_size, bert.num_attention_heads, bert.intermediate_size,
                          bert.vocab_size, settings.seq_len, dropout=bert.hidden_dropout_prob)
    if settings.kind == "transformer":
        return ModelShape("tiny", settings.layers, settings.hidden, settings.heads, settings.ffn, 0, settings.seq_len,
                          inputs=settings.input_dim, outputs=settings.output_dim)
    if settings.kind != "hf" or model.config.model_type not in ("gpt2", "llama"):
        raise ValueError(f"model.kind: the activation model covers bert, transformer and hf gpt2/llama, not {settings.kind}")
    hf = model.config
    if hf.model_type == "gpt2":
        return ModelShape("gpt2", hf.n_layer, hf.n_embd, hf.n_head, hf.n_inner or 4 * hf.n_embd, hf.vocab_size, settings.seq_len)
    return ModelShape("llama", hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.intermediate_size,
                      hf.vocab_size, settings.seq_len, kv_heads=hf.num_key_value_heads)


def stage_states(config: RunConfig, model) -> list[StageState]:
    """Every stage's parameters, read off the real stages (first-order runs)."""
    from pipefisher.runtime.gradient_path.buffers import unique_parameters

    num_stages = build_schedule(config).num_stages
    states = []
    for index in range(num_stages):
        parameters = unique_parameters(model.build_stage(index, num_stages, config.run.seed))
        states.append(StageState(tuple(p.numel() for p in parameters), shapes=tuple(tuple(p.shape) for p in parameters)))
    return states


def predict(config: RunConfig) -> list[RankPeak]:
    """The memory model's peak per rank for a first-order run file."""
    if config.curvature is not None:
        raise ValueError("optimizer.name: the check covers first-order runs; the curvature methods' captures need a plan and a profile")
    model = staged_model(config)
    topology = Topology(build_schedule(config), config.pipeline.data_parallel, config.pipeline.tensor_parallel)
    optimizer = optimizer_state(config.optimizer.name, getattr(config.optimizer, "momentum", 0.0))
    return peak_memory(topology, stage_states(config, model), optimizer, model_shape(config, model), config.data.micro_batch_size,
                       config.run.precision, getattr(config.model, "recompute", "none"), config.optimizer.zero,
                       powersgd_rank=config.comm.powersgd_rank)


def measure(rank: int, world: int, config: RunConfig) -> int:
    """Peak bytes of live tensors on this rank over the run's second step (a `run_group` worker)."""
    from pipefisher.runtime.training.trainer import build_executor, train_pipelined

    device = torch.device("cpu")
    executor, _ = build_executor(config, rank, device)
    probe = LiveTensorBytes()

    def on_step(result) -> None:
        if result.step == 1:
            probe.census()
            probe.__enter__()
        elif result.step == 2:
            probe.__exit__(None, None, None)

    train_pipelined(dataclasses.replace(config, run=dataclasses.replace(config.run, steps=2)), rank, device, on_step, executor)
    return probe.peak
