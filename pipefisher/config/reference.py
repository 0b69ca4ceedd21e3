"""The run-file key reference, generated from the declarations (docs/run-file-keys.md is its
output, held to it by a test), and the resolved run as YAML (`pipefisher config --show`). Pure Python."""

from __future__ import annotations

import dataclasses
import typing

import yaml

from pipefisher.config.run import FIRST_ORDER, RunConfig, config_to_dict
from pipefisher.core.settings import DescribedKey, described_keys
from pipefisher.methods.registry import methods
from pipefisher.methods.settings import RefreshConfig

HEADER = """# Run-file keys

Every key of a run file (`schedules/*.yaml`), generated from its declaration in the code
(`pipefisher config --keys` prints this page; `tests/test_config_reference.py` holds the page to
it). Any key can be set on the command line of `run`, `profile` and `config` as
`--SECTION.KEY VALUE` (YAML syntax: `--optimizer.betas "[0.9, 0.95]"`). Back to the
[README](../README.md); how run files are used: [run files](run-files.md).

Numbers are read as people write them, in a file and on the command line (YAML 1.2 and Python's
`float()`): `1e-3`, `3E-2`, `.5`, `1_000`. An integer key takes a whole number in any of these
forms (`steps: 1e3` is 1000; `2.5` is refused); a true/false key takes only `true` or `false`.
Counts of steps stop at 10^9 (12 days at 1 ms a step) and counts of processes or micro-batches
at 2^20: a larger value is a typo, refused with the key. A key written twice, or unknown
(`optimizer.lrr: unknown key; did you mean lr?`), is refused too.

A model or data key that the run's `model.kind` or `data.kind` does not read (its meaning names
the kinds that do) is refused when set to other than its default: `model.hidden: read by
model.kind transformer or mlp; this run's model.kind is bert (...); drop model.hidden`. A method's
section is read only when `optimizer.name` names the method: a run file may carry several for
`--optimizer` to choose from, and a `--METHOD.KEY` flag with another optimizer gets a warning.
"""


def _default(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(f"{v:g}" for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}" if float(f"{value:g}") == value else repr(value)  # as the loader reads it back
    return str(value)


def _table(keys: list[DescribedKey]) -> list[str]:
    lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key in keys:
        allowed = "" if key.range is None else str(key.range) + (f" ({key.range.note})" if key.range.note else "")
        if key.range is not None and key.range.ceiling is not None:
            allowed += f", at most {key.range.ceiling.most:,}"
        lines.append(f"| `{key.name}` | {key.type} | `{_default(key.default)}` | {allowed} | {key.doc} |")
    return lines


def _section(title: str, cls: type, keys: list[DescribedKey], before: str = "", after: str = "") -> list[str]:
    """A heading, the first paragraph of the section's docstring between `before` and `after`, its table."""
    summary = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
    return ["", f"## `{title}`", "", " ".join(part for part in (before, summary, after) if part), "", *_table(keys)]


def run_file_reference() -> str:
    """The Markdown page of every section and key, methods' sections from the registry."""
    hints = typing.get_type_hints(RunConfig)
    fixed = [field.name for field in dataclasses.fields(RunConfig) if field.name != "methods"]
    lines = [HEADER.rstrip()]
    for name in fixed[:4]:
        lines += _section(name, hints[name], described_keys(hints[name]))
    shared = described_keys(RefreshConfig)
    lines += _section(
        "<method>",
        RefreshConfig,
        shared,
        before=f"Sections {', '.join(methods())}: `optimizer.name` picks the method, or a first-order "
        f"optimizer ({', '.join(FIRST_ORDER)}).",
    )
    for name, method in methods().items():
        own = [key for key in described_keys(method.settings) if key not in shared]
        lines += _section(name, method.settings, own, after="Its own keys, besides those of `<method>`.")
    for name in fixed[4:]:
        lines += _section(name, hints[name], described_keys(hints[name]))
    return "\n".join(lines) + "\n"


def resolved_yaml(config: RunConfig) -> str:
    """The whole run, every key with the value it takes, as a run file."""
    data = {
        section: {key: list(value) if isinstance(value, tuple) else value for key, value in keys.items()}
        for section, keys in config_to_dict(config).items()
    }
    return yaml.safe_dump(data, sort_keys=False)
