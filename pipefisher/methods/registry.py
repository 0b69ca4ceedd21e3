"""The registry of curvature methods: the built-in ones (K-FAC, Shampoo, Muon, SOAP), those a program
registers (`register`) and those installed packages declare under the entry-point group
``pipefisher.methods`` (each entry a `CurvatureMethod`). Everything outside a method's folder
finds a method here, by name. Pure Python: no torch.

A name is taken once: `register` refuses a second, different method of a taken name, and an
installed plugin that does not load or whose name is taken is skipped with one warning line on
stderr (by the launching process, not again by each rank it starts): a broken or clashing plugin
never breaks the commands that do not use it, nor replaces a built-in method."""

from __future__ import annotations

import multiprocessing
import sys
from importlib.metadata import EntryPoint, entry_points

from pipefisher.core.ir import ScheduleError
from pipefisher.core.names import FIRST_ORDER
from pipefisher.methods.kfac.method import KFAC
from pipefisher.methods.method import CurvatureMethod, TaskRules
from pipefisher.methods.muon.method import MUON
from pipefisher.methods.shampoo.method import SHAMPOO
from pipefisher.methods.soap.method import SOAP

ENTRY_POINT_GROUP = "pipefisher.methods"
#: the method whose tasks `pipefisher profile` times for a first-order run, and the method of a
#: profile that names none (one built in memory, e.g. from the PipeFisher CSVs; files of format v1
#: that name none are K-FAC's by their own rule, `pipefisher.core.profile_v1.V1_METHOD`)
DEFAULT_METHOD = KFAC.name
#: the method whose task times the PipeFisher reference CSVs hold (`pipefisher bert-profile`, the
#: layout planner's modelled profiles)
REFERENCE_METHOD = KFAC.name

_BUILT_IN: tuple[CurvatureMethod, ...] = (KFAC, SHAMPOO, MUON, SOAP)
_METHODS: dict[str, CurvatureMethod] = {method.name: method for method in _BUILT_IN}
_entry_points_loaded = False


def register(method: CurvatureMethod) -> CurvatureMethod:
    """Make `method` known by its name; returns it. Registering the same object again is a no-op;
    ValueError if the name is not an identifier, is a first-order optimizer's, or is taken by
    another method (`unregister` it first)."""
    if not method.name.isidentifier() or method.name in FIRST_ORDER:
        raise ValueError(f"method name {method.name!r}: must be an identifier that is not a first-order optimizer")
    taken = _METHODS.get(method.name)
    if taken is not None and taken is not method:
        raise ValueError(f"method name {method.name!r} is taken by {_origin(taken)}; choose another name")
    _METHODS[method.name] = method
    return method


def _origin(method: CurvatureMethod) -> str:
    return f"the built-in {method.label}" if _built_in(method) else f"another method ({method.label})"


def _built_in(method: CurvatureMethod | None) -> bool:
    return any(method is built_in for built_in in _BUILT_IN)


def unregister(name: str) -> None:
    """Forget method `name` (tests that register one of their own); built-in methods stay."""
    if not _built_in(_METHODS.get(name)):
        _METHODS.pop(name, None)


def methods() -> dict[str, CurvatureMethod]:
    """Every known method by name, built-in ones first, then the installed plugins that load."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            _register_plugin(entry)
    return dict(_METHODS)


def _register_plugin(entry: EntryPoint) -> None:
    """Register the method entry point `entry` names, or warn in one line why it is skipped."""
    plugin = f"method plugin {entry.name!r} (entry point {entry.value})"
    try:
        loaded = entry.load()
    except Exception as exc:  # anything its import raises: the host goes on without it
        detail = str(exc).splitlines()[0] if str(exc) else ""
        return _warn(f"{plugin} did not load: {type(exc).__name__}: {detail}; commands that do not use it work")
    if not isinstance(loaded, CurvatureMethod):
        return _warn(f"{plugin} is a {type(loaded).__name__}, not a CurvatureMethod; skipped")
    try:
        register(loaded)
    except ValueError as exc:
        _warn(f"{plugin}: {exc}; skipped")


def _warn(message: str) -> None:
    """One warning line on stderr, from the process a user started (a rank the local launcher
    forked has a parent process and stays quiet: its launcher said it)."""
    if multiprocessing.parent_process() is None:
        print(f"pipefisher: warning: {message}", file=sys.stderr, flush=True)


def method(name: str) -> CurvatureMethod:
    """Method `name`; ScheduleError naming the known ones otherwise."""
    known = methods()
    if name not in known:
        raise ScheduleError(f"method: {name!r} is not a curvature method; use one of {', '.join(known)}")
    return known[name]


def method_of_profile(profile) -> CurvatureMethod:
    """The method whose tasks the layer times of `profile` (a `Profile`) are: the one it names,
    `DEFAULT_METHOD` where it names none (ScheduleError as `method`)."""
    return method(profile.method or DEFAULT_METHOD)


def task_rules(name: str) -> TaskRules:
    """The task rules of method `name` (ScheduleError as `method`)."""
    return method(name).rules


def method_of(config) -> CurvatureMethod:
    """The run's curvature method (`optimizer.name`); `DEFAULT_METHOD` for a first-order run
    (whose profile times that method's tasks)."""
    return methods().get(config.optimizer.name) or _METHODS[DEFAULT_METHOD]
