"""The sizes of a run's model as the layout planner needs them, read from the run file without
building the model (pure Python: no torch), and the planner's error.

BERT presets are listed here by their sizes (`pipefisher.models.bert.BERT_PRESETS` builds them
with torch); a BERT `model.config_json` and Hugging Face configs (`model.hf_config`, shipped or a
path) are read as JSON (GPT-2's and BERT/Llama's key names); each kind's function here is named by
its declaration (`ModelKind.sizes`). A kind without one (`model.kind mlp`: no attention block to
plan for) is a `PlanError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pipefisher.config import RunConfig
from pipefisher.data.settings import max_predictions
from pipefisher.models.kind import load
from pipefisher.models.registry import kinds, model_kind
from pipefisher.planning.memory.activations import ModelShape


class PlanError(ValueError):
    """What cannot be planned; the message names the input and what to change (one line)."""


#: (blocks, hidden, heads, ffn) of `pipefisher.models.bert.BERT_PRESETS`, by preset name
BERT_PRESET_SIZES = {
    "bert-tiny": (2, 128, 2, 512),
    "bert-mini": (4, 256, 4, 1024),
    "bert-4x128": (4, 128, 2, 512),
    "bert-base": (12, 768, 12, 3072),
    "bert-large": (24, 1024, 16, 4096),
}
#: dropout of the BERT presets (`model.dropout` -1)
BERT_DROPOUT = 0.1
#: config.json keys of each size, GPT-2's spelling first
_KEYS = {
    "blocks": ("n_layer", "num_hidden_layers"),
    "hidden": ("n_embd", "hidden_size"),
    "heads": ("n_head", "num_attention_heads"),
    "ffn": ("n_inner", "intermediate_size"),
    "vocab": ("vocab_size",),
}


@dataclass(frozen=True)
class ModelSizes:
    """A run's model as the planner takes it: its `kind` (run-file `model.kind`), `name` (the preset
    or config it came from, what the reference CSVs are named after), `shape` (blocks, hidden,
    heads, FFN width, vocabulary (0: none), sequence length and what the activation model needs
    beside them), `head_transform` and `tied`; the sizes are read off the shape."""

    kind: str
    name: str
    shape: ModelShape
    #: its heads transform the hidden state before the vocabulary projection (BERT's)
    head_transform: bool = False
    #: its word embedding is tied to its output projection: on more than one stage, a weight the
    #: first and the last stage share (which ZeRO-2/3 does not run yet)
    tied: bool = False

    @property
    def blocks(self) -> int:
        return self.shape.blocks

    @property
    def hidden(self) -> int:
        return self.shape.hidden

    @property
    def heads(self) -> int:
        return self.shape.heads

    @property
    def ffn(self) -> int:
        return self.shape.ffn

    @property
    def vocab(self) -> int:
        return self.shape.vocab

    @property
    def seq_len(self) -> int:
        return self.shape.seq_len

    @property
    def uneven_splits(self) -> bool:
        """Whether the model's kind takes `pipeline.stage_blocks` (`ModelKind.uneven_splits`)."""
        return model_kind(self.kind).uneven_splits

    def tensor_parallel_degrees(self, limit: int = 8) -> tuple[int, ...]:
        """Degrees T <= `limit` that divide both the heads and the FFN width (Megatron's split)."""
        return tuple(t for t in range(1, limit + 1) if self.heads % t == 0 and self.ffn % t == 0)


def _json_sizes(path: Path | Any, what: str) -> dict[str, Any]:
    """The sizes in a config.json, its architecture as the activation model names it (gpt2, bert;
    llama for the other decoders), key/value heads (0: as many as heads) and BERT's dropout."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"{what}: cannot read {path} as a JSON model config ({exc})") from None
    sizes: dict[str, Any] = {}
    for field, keys in _KEYS.items():
        value = next((data[key] for key in keys if data.get(key) is not None), None)
        if field == "ffn" and value is None and "hidden" in sizes:
            value = 4 * sizes["hidden"]  # GPT-2's n_inner null: 4 x n_embd
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{what}: {path} gives no {' or '.join(keys)}; the planner needs the model's {field}")
        sizes[field] = value
    model_type = data.get("model_type", "")
    sizes["architecture"] = model_type if model_type in ("gpt2", "bert") else "llama"
    sizes["kv_heads"] = data.get("num_key_value_heads") or 0
    sizes["dropout"] = data.get("hidden_dropout_prob", BERT_DROPOUT) if model_type == "bert" else 0.0
    sizes["tied"] = bool(data.get("tie_word_embeddings", True))  # transformers' default
    return sizes


def model_sizes(config: RunConfig) -> ModelSizes:
    """The sizes of `config`'s model, by its kind's `sizes` (`pipefisher.models.registry`);
    PlanError for a kind or preset without them."""
    kind = model_kind(config.model.kind)
    if not kind.sizes:
        plannable = [name for name, other in kinds().items() if other.sizes]
        raise PlanError(
            f"model.kind: {kind.name} has no attention blocks to plan a layout for; "
            f"use model.kind {', '.join(plannable[:-1])} or {plannable[-1]}"
        )
    return load(kind.sizes)(config)


def transformer_sizes(config: RunConfig) -> ModelSizes:
    """The sizes of model.kind transformer: its run-file keys."""
    model = config.model
    shape = ModelShape(
        "tiny",
        model.layers,
        model.hidden,
        model.heads,
        model.ffn,
        0,
        model.seq_len,
        inputs=model.input_dim,
        outputs=model.output_dim,
    )
    return ModelSizes("transformer", "transformer", shape)


def bert_sizes(config: RunConfig) -> ModelSizes:
    """The sizes of model.kind bert: its preset's, or its `model.config_json`'s; its heads have
    BERT's transform before the vocabulary projection, its decoder is the word embedding's copy."""
    model = config.model
    if model.config_json:
        return _config_json_sizes(
            config, Path(model.config_json), Path(model.config_json).stem, "model.config_json", True
        )
    if model.preset not in BERT_PRESET_SIZES:
        raise PlanError(f"model.preset: {model.preset!r} has no sizes here; use one of {', '.join(BERT_PRESET_SIZES)}")
    blocks, hidden, heads, ffn = BERT_PRESET_SIZES[model.preset]
    dropout = BERT_DROPOUT if model.dropout < 0 else model.dropout
    shape = ModelShape(
        "bert",
        blocks,
        hidden,
        heads,
        ffn,
        config.data.vocab_size,
        model.seq_len,
        dropout=dropout,
        predictions=_mlm_predictions(config, "bert"),
    )
    return ModelSizes("bert", model.preset, shape, head_transform=True, tied=True)


def hf_sizes(config: RunConfig) -> ModelSizes:
    """The sizes of model.kind hf: its `model.hf_config`'s (shipped or a path)."""
    model = config.model
    shipped = resources.files("pipefisher.models").joinpath("hf_configs").joinpath(f"{model.hf_config}.json")
    return _config_json_sizes(
        config, shipped if shipped.is_file() else Path(model.hf_config), model.hf_config, "model.hf_config", False
    )


def _config_json_sizes(config: RunConfig, where: Path | Any, name: str, key: str, head_transform: bool) -> ModelSizes:
    """The sizes of the config.json at `where` (named `name`, read for run-file key `key`);
    `head_transform`: pipefisher's BERT, whose decoder is always tied to the word embedding."""
    model = config.model
    found = _json_sizes(where, key)
    dropout = found["dropout"] if model.dropout < 0 or found["architecture"] != "bert" else model.dropout
    shape = ModelShape(
        found["architecture"],
        found["blocks"],
        found["hidden"],
        found["heads"],
        found["ffn"],
        found["vocab"],
        model.seq_len,
        kv_heads=found["kv_heads"],
        dropout=dropout,
        predictions=_mlm_predictions(config, found["architecture"]),
    )
    return ModelSizes(model.kind, name, shape, head_transform, head_transform or found["tied"])


def _mlm_predictions(config: RunConfig, architecture: str) -> int:
    """Positions per sequence a BERT's MLM head runs on when its data are BERT pretraining
    micro-batches (their `mlm_positions` width, as the runtime's memory check counts them); 0
    (every position) otherwise."""
    if architecture != "bert" or config.data.kind not in ("bert", "shards"):
        return 0
    return max_predictions(config.model.seq_len, config.data.mask_prob)
