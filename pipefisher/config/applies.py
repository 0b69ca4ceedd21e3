"""Which model and data kinds read which keys: a key set (to other than its default) that the
run's `model.kind` or `data.kind` does not read is refused in one line naming what reads it,
instead of being ignored in silence. One table, `applies`: the model keys each registered model
kind declares it reads, and `DATA_APPLIES`; keys not in it are read by every kind.

Curvature-method sections are not in it: a run file carries the sections of several methods for
`--optimizer` to choose from (`schedules/tiny-cpu.yaml`), so a method's section set while another
optimizer runs is silent in a run file and a warning on the command line (`warn_without_effect`).
Pure Python."""

from __future__ import annotations

import dataclasses
from typing import Any

from pipefisher.core.settings import ConfigError
from pipefisher.models.registry import kinds, model_kind, readers

_TEXT = ("bert", "causal")

#: "data.key" -> the data kinds that read it; the model part of the table is each model kind's
#: declared keys (`pipefisher.models.kind.ModelKind.keys`)
DATA_APPLIES: dict[str, tuple[str, ...]] = {
    "data.corpus": _TEXT,
    "data.vocab_size": _TEXT,
    "data.holdout": _TEXT,
    "data.vocab": ("bert",),
    "data.mask_prob": ("bert", "shards"),
    "data.shards": ("shards",),
}
#: what a data kind reads instead of the keys of others, for the refusal's last words
_DATA_INSTEAD = {
    "synthetic": "it makes regression data from data.seed alone",
    "shards": "its text, tokenizer and vocabulary are the prepared folder's",
}


def applies(config: Any) -> dict[str, tuple[str, tuple[str, ...]]]:
    """ "section.key" -> (the key that chooses, the values of it that read the key): the `model`
    keys some registered model kind does not read (in `ModelConfig`'s order), then `DATA_APPLIES`."""
    model_keys = {
        f"model.{field.name}": ("model.kind", readers(field.name)) for field in dataclasses.fields(config.model)
    }
    every = tuple(kinds())
    return {key: rule for key, rule in model_keys.items() if rule[1] != every} | {
        key: ("data.kind", kinds_of_data) for key, kinds_of_data in DATA_APPLIES.items()
    }


def _instead(chooser: str, chosen: str) -> str:
    """What the chosen kind reads instead of a key it does not ("" = nothing to say)."""
    if chooser == "model.kind":
        return model_kind(chosen).instead
    return _DATA_INSTEAD.get(chosen, "")


def _value(config: Any, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _default(config: Any, key: str) -> Any:
    section, name = key.split(".")
    return next(field.default for field in dataclasses.fields(getattr(config, section)) if field.name == name)


def check_applies(config: Any) -> None:
    """ConfigError for the first key of `applies(config)` set to other than its default while the run's
    choosing key has a value that does not read it: "model.hidden: read by model.kind transformer
    or mlp; this run's model.kind is bert (its size comes from model.preset ...); drop it"."""
    for key, (chooser, reading) in applies(config).items():
        chosen = _value(config, chooser)
        if chosen not in reading and _value(config, key) != _default(config, key):
            instead = _instead(chooser, chosen)
            raise ConfigError(
                f"{key}: read by {chooser} {' or '.join(reading)}; this run's {chooser} is {chosen}"
                + (f" ({instead})" if instead else "")
                + f"; drop {key}"
            )
