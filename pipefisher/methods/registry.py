"""The registry of curvature methods: the built-in ones (K-FAC, Shampoo, Muon, SOAP), those a program
registers (`register`) and those installed packages declare under the entry-point group
``pipefisher.methods`` (each entry a `CurvatureMethod`). Everything outside a method's folder
finds a method here, by name. Pure Python: no torch.

A name is taken once, and a broken or clashing plugin is skipped with one warning line
(`pipefisher.core.plugins.PluginRegistry`)."""

from __future__ import annotations

from pipefisher.core.ir import ScheduleError
from pipefisher.core.plugins import PluginRegistry
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


def _check_name(method: CurvatureMethod) -> None:
    if not method.name.isidentifier() or method.name in FIRST_ORDER:
        raise ValueError(f"method name {method.name!r}: must be an identifier that is not a first-order optimizer")


_REGISTRY = PluginRegistry(
    "method",
    CurvatureMethod,
    ENTRY_POINT_GROUP,
    (KFAC, SHAMPOO, MUON, SOAP),
    name_of=lambda method: method.name,
    label_of=lambda method: method.label,
    check=_check_name,
)
#: make a method known by its name (returns it; ValueError if the name is not an identifier, is a
#: first-order optimizer's, or is taken by another method); forget one (built-in ones stay)
register, unregister = _REGISTRY.register, _REGISTRY.unregister
#: read the installed plugins again on next use (a package installed since)
read_entry_points_again = _REGISTRY.read_entry_points_again


def methods() -> dict[str, CurvatureMethod]:
    """Every known method by name, built-in ones first, then the installed plugins that load."""
    return _REGISTRY.known()


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
    known = methods()
    return known.get(config.optimizer.name) or known[DEFAULT_METHOD]
