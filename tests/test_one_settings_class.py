"""Each method has one settings class, its run-file section, and its engine takes it; each closed
set of names of `pipefisher.core.names` is spelled once in the package."""

import ast
import dataclasses
import importlib
import inspect
import typing
from pathlib import Path

import pytest

from pipefisher.core import names
from pipefisher.core.settings import described_keys
from pipefisher.methods.registry import methods
from pipefisher.methods.settings import RefreshConfig

PACKAGE = Path(__file__).resolve().parents[1] / "pipefisher"
BUILT_IN = ("kfac", "shampoo", "soap", "muon")


def classes_in(folder: Path) -> dict[str, Path]:
    return {
        node.name: path
        for path in folder.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_method_has_one_settings_class_and_its_engine_takes_it(name):
    settings = methods()[name].settings
    assert issubclass(settings, RefreshConfig) and settings.__dataclass_params__.frozen
    assert [key.name for key in described_keys(settings)] == [f.name for f in dataclasses.fields(settings)]
    second = [
        cls
        for cls in classes_in(PACKAGE / "methods" / name)
        if cls.endswith(("Settings", "Config")) and cls != settings.__name__
    ]
    assert not second, f"{name}: settings classes besides {settings.__name__}: {second}"
    engine = next(
        cls
        for cls_name, cls in vars(importlib.import_module(f"pipefisher.methods.{name}.engine")).items()
        if cls_name.endswith("Engine") and inspect.isclass(cls) and cls.__module__.endswith(".engine")
    )
    taken = typing.get_type_hints(engine.__init__)[
        "settings" if "settings" in inspect.signature(engine).parameters else "config"
    ]
    assert settings in (taken, *typing.get_args(taken)), f"{engine.__name__} takes {taken}, not {settings.__name__}"


CLOSED_SETS = {name: value for name, value in vars(names).items() if name.isupper() and isinstance(value, tuple)}


def test_the_closed_sets_are_literals_of_the_names_module():
    assert set(CLOSED_SETS) >= {"FIRST_ORDER", "PRECISIONS", "BACKENDS", "RECOMPUTE_MODES"}


def test_each_closed_set_of_names_is_spelled_once():
    """No tuple, list or Literal of exactly a closed set's names outside `pipefisher.core.names`."""
    spelled = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "core" / "names.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, (ast.Tuple, ast.List))
                and node.elts
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
            ):
                found = {e.value for e in node.elts}
                spelled += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno} {name}"
                    for name, value in CLOSED_SETS.items()
                    if found == set(value)
                ]
    assert not spelled, "spelled again (import it from pipefisher.core.names): " + ", ".join(spelled)
