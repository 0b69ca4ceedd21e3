"""The registry of curvature methods: the built-in ones (K-FAC, Shampoo, Muon, SOAP), those a program
registers (`register`) and those installed packages declare under the entry-point group
``pipefisher.methods`` (each entry a `CurvatureMethod`). Everything outside a method's folder
finds a method here, by name. Pure Python: no torch."""

from __future__ import annotations

from importlib.metadata import entry_points

from pipefisher.core.ir import ScheduleError
from pipefisher.methods.kfac.method import KFAC
from pipefisher.methods.method import CurvatureMethod, TaskRules
from pipefisher.methods.muon.method import MUON
from pipefisher.methods.shampoo.method import SHAMPOO
from pipefisher.methods.soap.method import SOAP

ENTRY_POINT_GROUP = "pipefisher.methods"
#: the method of profile and plan files written before they named one, and the method whose
#: tasks `pipefisher profile` times for a first-order run
DEFAULT_METHOD = KFAC.name

_METHODS: dict[str, CurvatureMethod] = {method.name: method for method in (KFAC, SHAMPOO, MUON, SOAP)}
_entry_points_loaded = False


def register(method: CurvatureMethod) -> CurvatureMethod:
    """Make `method` known by its name (again: the newer declaration wins); returns it."""
    if not method.name.isidentifier() or method.name in ("sgd", "adamw", "lamb"):
        raise ValueError(f"method name {method.name!r}: must be an identifier that is not a first-order optimizer")
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    """Forget method `name` (tests that register one of their own)."""
    _METHODS.pop(name, None)


def methods() -> dict[str, CurvatureMethod]:
    """Every known method by name, built-in ones first."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            register(entry.load())
    return dict(_METHODS)


def method(name: str) -> CurvatureMethod:
    """Method `name`; ScheduleError naming the known ones otherwise."""
    known = methods()
    if name not in known:
        raise ScheduleError(f"method: {name!r} is not a curvature method; use one of {', '.join(known)}")
    return known[name]


def task_rules(name: str) -> TaskRules:
    """The task rules of method `name` (ScheduleError as `method`)."""
    return method(name).rules


def method_of(config) -> CurvatureMethod:
    """The run's curvature method (`optimizer.name`); `DEFAULT_METHOD` for a first-order run
    (whose profile times that method's tasks)."""
    return methods().get(config.optimizer.name) or _METHODS[DEFAULT_METHOD]
