"""A registry of named declarations of one type (curvature methods, model kinds): the built-in
ones, those a program registers and those installed packages declare under an entry-point group.
Pure Python: no torch.

A name is taken once: `register` refuses a second, different declaration of a taken name, and an
installed plugin that does not load, is not of the type or whose name is taken is skipped with one
warning line on stderr (by the process a user started, not again by each rank its launcher starts):
a broken or clashing plugin never breaks what does not use it, nor replaces a built-in."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


class PluginRegistry(Generic[T]):
    """Declarations of type `kind` by name (`name_of`): `built_in` first, then those registered
    or read from entry-point `group` on first use. `what` names a declaration in messages
    ("method", "model kind") and `label_of` one in words ("K-FAC"); `check(declaration)` raises
    ValueError for a name the registry refuses whoever declares it."""

    def __init__(
        self,
        what: str,
        kind: type[T],
        group: str,
        built_in: Iterable[T],
        name_of: Callable[[T], str],
        label_of: Callable[[T], str] | None = None,
        check: Callable[[T], None] = lambda declaration: None,
    ) -> None:
        self.what, self.kind, self.group, self.name_of, self.check = what, kind, group, name_of, check
        self.label_of = label_of
        self.built_in = tuple(built_in)
        self._known: dict[str, T] = {name_of(declaration): declaration for declaration in self.built_in}
        self._entry_points_read = False

    def is_built_in(self, declaration: T | None) -> bool:
        return any(declaration is built_in for built_in in self.built_in)

    def register(self, declaration: T) -> T:
        """Make `declaration` known by its name; returns it. Registering the same object again is a
        no-op; ValueError if `check` refuses it or another declaration has the name."""
        self.check(declaration)
        name = self.name_of(declaration)
        taken = self._known.get(name)
        if taken is not None and taken is not declaration:
            origin = self._origin(taken)
            raise ValueError(f"{self.what} name {name!r} is taken by {origin}; choose another name")
        self._known[name] = declaration
        return declaration

    def _origin(self, declaration: T) -> str:
        if self.label_of is None:
            return f"a built-in {self.what}" if self.is_built_in(declaration) else f"another {self.what}"
        label = self.label_of(declaration)
        return f"the built-in {label}" if self.is_built_in(declaration) else f"another {self.what} ({label})"

    def unregister(self, name: str) -> None:
        """Forget `name` (tests that register one of their own); built-in ones stay."""
        if not self.is_built_in(self._known.get(name)):
            self._known.pop(name, None)

    def known(self) -> dict[str, T]:
        """Every known declaration by name (a copy), the installed plugins read in on first use."""
        if not self._entry_points_read:
            self._entry_points_read = True
            for entry in entry_points(group=self.group):
                self._register_plugin(entry)
        return dict(self._known)

    def read_entry_points_again(self) -> None:
        """Read the entry-point group again on next use (a package installed since the first)."""
        self._entry_points_read = False

    def _register_plugin(self, entry: EntryPoint) -> None:
        """Register what `entry` names, or warn in one line why it is skipped."""
        plugin = f"{self.what} plugin {entry.name!r} (entry point {entry.value})"
        try:
            loaded = entry.load()
        except Exception as exc:  # anything its import raises: the host goes on without it
            detail = str(exc).splitlines()[0] if str(exc) else ""
            return warn(
                f"{plugin} did not load: {type(exc).__name__}: {detail}; runs and commands that do not use it work"
            )
        if not isinstance(loaded, self.kind):
            return warn(f"{plugin} is a {type(loaded).__name__}, not a {self.kind.__name__}; skipped")
        try:
            self.register(loaded)
        except ValueError as exc:
            warn(f"{plugin}: {exc}; skipped")


def warn(message: str) -> None:
    """One warning line on stderr, from the process a user started (a rank the local launcher
    started has a parent process and stays quiet: its launcher said it)."""
    if multiprocessing.parent_process() is None:
        print(f"pipefisher: warning: {message}", file=sys.stderr, flush=True)
