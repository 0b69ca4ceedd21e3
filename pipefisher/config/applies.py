"""Which model and data kinds read which keys: a key set (to other than its default) that the
run's `model.kind` or `data.kind` does not read is refused in one line naming what reads it,
instead of being ignored in silence. One table, `APPLIES`; keys not in it are read by every kind.

Curvature-method sections are not in it: a run file carries the sections of several methods for
`--optimizer` to choose from (`schedules/tiny-cpu.yaml`), so a method's section set while another
optimizer runs is silent in a run file and a warning on the command line (`warn_without_effect`).
Pure Python."""

from __future__ import annotations

import dataclasses
from typing import Any

from pipefisher.core.settings import ConfigError

_NETS = ("transformer", "mlp")
_TEXT = ("bert", "causal")

#: "section.key" -> (the key that chooses, the values of it that read the key)
APPLIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "model.preset": ("model.kind", ("bert",)),
    "model.config_json": ("model.kind", ("bert",)),
    "model.hf_config": ("model.kind", ("hf",)),
    "model.hf_class": ("model.kind", ("hf",)),
    "model.hf_weights": ("model.kind", ("hf",)),
    "model.dropout": ("model.kind", ("bert", "hf")),
    "model.layers": ("model.kind", _NETS),
    "model.hidden": ("model.kind", _NETS),
    "model.heads": ("model.kind", ("transformer",)),
    "model.ffn": ("model.kind", ("transformer",)),
    "model.input_dim": ("model.kind", _NETS),
    "model.output_dim": ("model.kind", _NETS),
    "data.corpus": ("data.kind", _TEXT),
    "data.vocab_size": ("data.kind", _TEXT),
    "data.holdout": ("data.kind", _TEXT),
    "data.vocab": ("data.kind", ("bert",)),
    "data.mask_prob": ("data.kind", ("bert",)),
}

#: what a kind reads instead of the keys of others, for the refusal's last words
_INSTEAD = {
    "model.kind bert": "its size comes from model.preset or model.config_json",
    "model.kind hf": "its size comes from model.hf_config",
    "data.kind synthetic": "it makes regression data from data.seed alone",
}


def _value(config: Any, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _default(config: Any, key: str) -> Any:
    section, name = key.split(".")
    return next(field.default for field in dataclasses.fields(getattr(config, section)) if field.name == name)


def check_applies(config: Any) -> None:
    """ConfigError for the first key of `APPLIES` set to other than its default while the run's
    choosing key has a value that does not read it: "model.hidden: read by model.kind transformer
    or mlp; this run's model.kind is bert (its size comes from model.preset ...); drop it"."""
    for key, (chooser, readers) in APPLIES.items():
        chosen = _value(config, chooser)
        if chosen not in readers and _value(config, key) != _default(config, key):
            instead = _INSTEAD.get(f"{chooser} {chosen}")
            raise ConfigError(f"{key}: read by {chooser} {' or '.join(readers)}; this run's {chooser} is {chosen}"
                              + (f" ({instead})" if instead else "") + f"; drop {key}")
