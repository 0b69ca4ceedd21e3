"""The built-in model kinds' declarations (`pipefisher.models.kind.ModelKind`): the regression
models (transformer, mlp), BERT pretraining (bert) and Hugging Face models (hf). Pure Python: no
torch; each kind's builder, planner sizes and activation shape are named, imported when used."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from pipefisher.models.kind import ModelKind

_BUILDERS = "pipefisher.runtime.training.model_builders"
_SIZES = "pipefisher.planning.planner.model_sizes"
_SHAPES = "pipefisher.runtime.training.memory_check"
_REGRESSION_KEYS = ("layers", "hidden", "input_dim", "output_dim")


def _regression_shape(model: Any) -> str:
    return f"layers {model.layers} hidden {model.hidden} input_dim {model.input_dim} output_dim {model.output_dim}"


def _transformer_problem(model: Any) -> str:
    return (
        f"model.heads: {model.heads} does not divide model.hidden {model.hidden}" if model.hidden % model.heads else ""
    )


TRANSFORMER = ModelKind(
    "transformer",
    ("synthetic",),
    (*_REGRESSION_KEYS, "heads", "ffn"),
    lambda model: f"transformer {_regression_shape(model)} heads {model.heads} ffn {model.ffn}",
    f"{_BUILDERS}:regression_model",
    sizes=f"{_SIZES}:transformer_sizes",
    activation_shape=f"{_SHAPES}:transformer_shape",
    blocks_key="layers",
    tensor_parallel_divides=("heads", "ffn"),
    check=_transformer_problem,
    uneven_splits=True,
)

MLP = ModelKind(
    "mlp",
    ("synthetic",),
    _REGRESSION_KEYS,
    lambda model: f"mlp {_regression_shape(model)}",
    f"{_BUILDERS}:regression_model",
    blocks_key="layers",
    tensor_parallel=False,
    uneven_splits=True,
)

BERT = ModelKind(
    "bert",
    ("bert",),
    ("preset", "config_json", "dropout"),
    lambda model: f"bert {Path(model.config_json).name if model.config_json else model.preset}",
    f"{_BUILDERS}:bert_model",
    sizes=f"{_SIZES}:bert_sizes",
    activation_shape=f"{_SHAPES}:bert_shape",
    naming_keys=("preset", "config_json"),
    instead="its size comes from model.preset or model.config_json",
    uneven_splits=True,
)


def _hf_modules(model: Any) -> tuple[str, ...]:
    """transformers' model code and, from the config's ``model_type``, the family's modeling module
    (about 3 s of imports per process)."""
    shipped = resources.files("pipefisher.models").joinpath("hf_configs").joinpath(f"{model.hf_config}.json")
    try:
        values = json.loads(shipped.read_text() if shipped.is_file() else Path(model.hf_config).read_text())
        model_type = str(values.get("model_type", ""))
    except (OSError, ValueError, AttributeError):  # the builder names what is wrong with the config
        model_type = ""
    family = (f"transformers.models.{model_type}.modeling_{model_type}",) if model_type.isidentifier() else ()
    return ("pipefisher.models.hf", "transformers.modeling_utils", *family)


HF = ModelKind(
    "hf",
    ("causal", "bert"),
    ("hf_config", "hf_class", "hf_weights", "dropout"),
    lambda model: " ".join(part for part in ("hf", Path(model.hf_config).name, model.hf_class) if part),
    f"{_BUILDERS}:hf_model",
    sizes=f"{_SIZES}:hf_sizes",
    activation_shape=f"{_SHAPES}:hf_shape",
    naming_keys=("hf_config", "hf_class"),
    instead="its size comes from model.hf_config",
    exports=True,
    uneven_splits=True,
    preload=_hf_modules,
)

BUILT_IN: tuple[ModelKind, ...] = (TRANSFORMER, MLP, BERT, HF)
