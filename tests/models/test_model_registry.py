"""The model registry is the one place that knows the model kinds: no module outside a kind's own
code compares `model.kind` with a kind's name, and the registry imports without torch."""

import ast
import subprocess
import sys
from pathlib import Path

from pipefisher.models.registry import kinds

PACKAGE = Path(__file__).resolve().parents[2] / "pipefisher"
#: the transformer and mlp kinds' own model (one class builds both, by its `config.kind`), and the
#: activation model, whose `ModelShape.kind` names architectures (tiny, gpt2, bert, llama)
KIND_MODULES = ("models/tiny.py", "planning/memory/activations.py")
#: receivers of `.kind` that name other vocabularies: data kinds, the activation model's architectures
OTHER_KINDS = ("data", "shape")


def _strings(node: ast.expr) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*map(_strings, node.elts)) if node.elts else set()
    return set()


def _receiver(node: ast.expr) -> str:
    return (
        node.value.attr
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
        else (node.value.id if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) else "")
    )


def kind_comparisons() -> list[str]:
    """Every `<x>.kind ==/!=/in <a model kind's name>` in the package outside `KIND_MODULES`
    (a `<...>data.kind` or `<...>shape.kind` compared is another vocabulary)."""
    names = set(kinds())
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in KIND_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            kinds_compared = [
                side
                for side in sides
                if isinstance(side, ast.Attribute) and side.attr == "kind" and not _receiver(side).endswith(OTHER_KINDS)
            ]
            if kinds_compared and names & set().union(*map(_strings, sides)):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_no_module_compares_the_model_kind():
    assert kind_comparisons() == []


def test_the_registry_is_torch_free():
    code = "import sys\nimport pipefisher.models.registry\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
