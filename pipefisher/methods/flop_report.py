"""The lines `pipefisher profile` prints about the achieved FLOP/s of each task kind of a profile
(`pipefisher.core.profile_flops.task_rates`), in the method's words. Pure Python."""

from __future__ import annotations

from pipefisher.core.profile import Profile
from pipefisher.core.profile_flops import STEP_END_FLOPS, TaskRate, task_rates
from pipefisher.methods.method import WorkLabels
from pipefisher.methods.registry import method_of_profile

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(value: float, unit: str) -> str:
    """`value` with an SI prefix: si(2.5e9, "FLOP/s") -> "2.50 GFLOP/s"."""
    scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(value) >= s), (1.0, ""))
    return f"{value / scale:.3g} {prefix}{unit}"


def task_label(labels: WorkLabels, rate: TaskRate) -> tuple[str, str]:
    """(what the task kind is called, what one execution is) in the method's words."""
    part = labels.parts[rate.part] if rate.part is not None and rate.part < len(labels.parts) else ""
    if rate.work == "refresh":
        return f"{part} {labels.refresh}".strip(), labels.refresh
    if rate.work in ("precondition", "fold"):
        return getattr(labels, rate.work), "step"
    if rate.work == STEP_END_FLOPS:
        return "its work in the end of step", "step"
    return f"{part} {rate.work}".strip(), "micro-batch" if rate.work == "curvature" else rate.work


def flop_report(profile: Profile) -> list[str]:
    """A header and one line per task kind with a flop count: flops per execution, the summed
    median time, the achieved FLOP/s and its share of the device's rate for the task's dtype
    (the published dense peak, or the measured matrix product's rate, said so); [] without counts."""
    rates = task_rates(profile)
    if not rates:
        return []
    labels = method_of_profile(profile).rules.labels
    measured = profile.flop_rates is not None and profile.flop_rates.measured
    against = "this device's measured matmul rate" if measured else "the device's dense peak"
    lines = [f"{labels.method} task FLOP/s (flop counts over median times, all layers and stages; vs {against}):"]
    for rate in rates:
        name, unit = task_label(labels, rate)
        if rate.peak is None:
            share = f"no peak known for {rate.dtype or 'its dtype'}"
        else:
            kind = f"measured {rate.dtype} matmul" if measured else f"{rate.dtype} peak"
            share = f"{100 * (rate.share or 0.0):.1f} % of the {kind} ({si(rate.peak, 'FLOP/s')})"
        lines.append(
            f"  {name}: {si(rate.flops, 'FLOP')} per {unit} in {rate.seconds * 1e3:.3f} ms, "
            f"{si(rate.rate, 'FLOP/s')}, {share}"
        )
    return lines
