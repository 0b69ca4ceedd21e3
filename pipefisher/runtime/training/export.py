"""`pipefisher export`: a pipelined run's checkpoint as a Hugging Face model folder.

A checkpoint keeps every parameter under the unsplit model's name (`checkpoint_state`), so the
unsplit model's state dict is its ``model/`` entries, each joined from its tensor-parallel shards. It is loaded into
the `transformers` model object and written with `save_pretrained`, beside the run's tokenizer,
so `AutoModel*.from_pretrained(folder)` and `tokenizers.Tokenizer.from_file` read it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from pipefisher.config import ConfigError, RunConfig
from pipefisher.core.terminal import progress_bars
from pipefisher.core.files import write_folder_atomically
from pipefisher.models.hf import HfStagedModel
from pipefisher.models.registry import model_kind
from pipefisher.models.tensor_parallel import join_shard_states
from pipefisher.runtime.training.assembly import build_run
from pipefisher.runtime.training.checkpoint import StateReader
from pipefisher.runtime.training.resumption import resumable_step


@dataclass(frozen=True)
class Exported:
    """What `export_checkpoint` wrote: the folder, the checkpoint's step, the model class, the
    number of parameters and their size in bytes (a tied weight once)."""

    folder: Path
    step: int
    model_class: str
    parameters: int
    weights_bytes: int


def merged_state_dict(config: RunConfig, step: int, model: Any = None) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict from the checkpoint of `step`: its ``model/`` entries, each
    joined from its tensor-parallel shards (`join_shard_states`; `model`: the run's staged model, if built)."""
    degree = config.pipeline.tensor_parallel
    reader = StateReader(config.checkpoint.dir, step)
    entries = {key[len("model/") :]: reader.get(key) for key in reader.keys("model/")}
    if degree == 1:
        return entries
    plan = (model if model is not None else build_run(config).model).tensor_parallel_plan(degree)
    shards = [
        {key.rpartition("@")[0]: value for key, value in entries.items() if key.endswith(f"@{shard}")}
        for shard in range(degree)
    ]
    return join_shard_states(shards, plan)


@contextmanager
def _transformers_progress_bars(shown: bool) -> Iterator[None]:
    """`transformers`' own progress bars ("Writing model shards") on or off while the context lasts."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    (logging.enable_progress_bar if shown else logging.disable_progress_bar)()
    try:
        yield
    finally:
        (logging.enable_progress_bar if was else logging.disable_progress_bar)()


def export_checkpoint(config: RunConfig, folder: str | Path) -> Exported:
    """Write the newest checkpoint of `config` that verifies (in checkpoint.dir) to `folder` as a
    Hugging Face model folder (config.json, model.safetensors, tokenizer.json). ConfigError when
    the run's model is not a Hugging Face model; CheckpointError when there is no usable checkpoint."""
    if not model_kind(config.model.kind).exports:
        raise ConfigError(f"model.kind: export writes Hugging Face models; this run's model is {config.model.kind!r}")
    step, _ = resumable_step(config.checkpoint.dir, config)
    run = build_run(config)
    if not isinstance(run.model, HfStagedModel):
        raise ConfigError(f"model.kind: {config.model.kind!r} builds no Hugging Face model to export")
    unsplit = run.model.unsplit(config.run.seed)
    unsplit.load_state_dict(merged_state_dict(config, step, run.model))
    folder = Path(folder)

    def write(temporary: Path) -> None:
        with _transformers_progress_bars(progress_bars()):
            unsplit.save_pretrained(temporary)
        run.text_data.tokenizer.save(str(temporary / "tokenizer.json"))

    write_folder_atomically(folder, write)
    parameters = list(unsplit.parameters())
    return Exported(
        folder,
        step,
        type(unsplit).__name__,
        sum(p.numel() for p in parameters),
        sum(p.numel() * p.element_size() for p in parameters),
    )
