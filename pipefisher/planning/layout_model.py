"""The sizes of a run's model as the layout planner needs them, read from the run file without
building the model (pure Python: no torch), and the planner's error.

BERT presets are listed here by their sizes (`pipefisher.models.bert.BERT_PRESETS` builds them
with torch); a BERT `model.config_json` and Hugging Face configs (`model.hf_config`, shipped or a
path) are read as JSON (GPT-2's and BERT/Llama's key names). `model.kind mlp` has no attention
block to plan for: `PlanError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pipefisher.config import RunConfig


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
#: config.json keys of each size, GPT-2's spelling first
_KEYS = {"blocks": ("n_layer", "num_hidden_layers"), "hidden": ("n_embd", "hidden_size"),
         "heads": ("n_head", "num_attention_heads"), "ffn": ("n_inner", "intermediate_size"),
         "vocab": ("vocab_size",)}


@dataclass(frozen=True)
class ModelSizes:
    """A Transformer's sizes: `blocks` attention blocks of width `hidden`, `heads` heads, an FFN of
    `ffn` features, a vocabulary of `vocab` tokens (0: none), sequences of `seq_len` tokens;
    `name`: the preset or config it came from (what the reference CSVs are named after)."""

    kind: str
    name: str
    blocks: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int

    def tensor_parallel_degrees(self, limit: int = 8) -> tuple[int, ...]:
        """Degrees T <= `limit` that divide both the heads and the FFN width (Megatron's split)."""
        return tuple(t for t in range(1, limit + 1) if self.heads % t == 0 and self.ffn % t == 0)


def _json_sizes(path: Path | Any, what: str) -> dict[str, int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"{what}: cannot read {path} as a JSON model config ({exc})") from None
    sizes = {}
    for field, keys in _KEYS.items():
        value = next((data[key] for key in keys if data.get(key) is not None), None)
        if field == "ffn" and value is None and "hidden" in sizes:
            value = 4 * sizes["hidden"]  # GPT-2's n_inner null: 4 x n_embd
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{what}: {path} gives no {' or '.join(keys)}; the planner needs the model's {field}")
        sizes[field] = value
    return sizes


def model_sizes(config: RunConfig) -> ModelSizes:
    """The sizes of `config`'s model (PlanError for a kind or preset without them)."""
    model = config.model
    if model.kind == "mlp":
        raise PlanError("model.kind: mlp has no attention blocks to plan a layout for; use model.kind bert, hf or transformer")
    if model.kind == "transformer":
        return ModelSizes("transformer", "transformer", model.layers, model.hidden, model.heads, model.ffn, 0, model.seq_len)
    if model.kind == "bert" and not model.config_json:
        if model.preset not in BERT_PRESET_SIZES:
            raise PlanError(f"model.preset: {model.preset!r} has no sizes here; use one of {', '.join(BERT_PRESET_SIZES)}")
        blocks, hidden, heads, ffn = BERT_PRESET_SIZES[model.preset]
        return ModelSizes("bert", model.preset, blocks, hidden, heads, ffn, config.data.vocab_size, model.seq_len)
    if model.kind == "bert":
        where, name = Path(model.config_json), Path(model.config_json).stem
    else:
        shipped = resources.files("pipefisher.models").joinpath("hf_configs", f"{model.hf_config}.json")
        where = shipped if shipped.is_file() else Path(model.hf_config)
        name = model.hf_config
    found = _json_sizes(where, "model.config_json" if model.kind == "bert" else "model.hf_config")
    return ModelSizes(model.kind, name, found["blocks"], found["hidden"], found["heads"], found["ffn"], found["vocab"], model.seq_len)
