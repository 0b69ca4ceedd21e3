"""The house as the code draws it: small modules, and curvature methods that are plugins (a
method's name appears outside its own folder and the registry only in documentation)."""

import ast
from pathlib import Path

import pytest

from pipefisher.methods.registry import methods

PACKAGE = Path(__file__).resolve().parents[1] / "pipefisher"
MAX_LINES = 400


def test_no_module_is_longer_than_the_limit():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.add(id(first.value))
    return found


#: the declared compatibility rule of the version-1 file formats, which names the one method the
#: versions that wrote them knew (a v1 profile without `method` is its)
COMPATIBILITY_RULES = ("core/profile_v1.py",)


def code_mentions(name: str, spellings: tuple[str, ...]) -> list[str]:
    """`file:line` of every identifier, attribute or string (docstrings left out) that holds one
    of `spellings` (lower case), outside the folder of method `name`, the registry and the v1
    formats' compatibility rule."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(f"methods/{name}/") or relative in ("methods/registry.py", *COMPATIBILITY_RULES):
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            text = None
            if isinstance(node, ast.Name):
                text = node.id
            elif isinstance(node, ast.Attribute):
                text = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                text = node.value
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                text = " ".join([getattr(node, "module", "") or "", *(alias.name for alias in node.names)])
            if text is not None and any(spelling in text.lower() for spelling in spellings):
                found.append(f"{relative}:{node.lineno}: {text[:60]!r}")
    return found


@pytest.mark.parametrize("method", list(methods().values()), ids=lambda method: method.name)
def test_a_method_is_named_only_in_its_folder_and_the_registry(method):
    assert code_mentions(method.name, (method.name, method.label.lower())) == []
