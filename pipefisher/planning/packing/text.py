"""The readable text of a packing: what `pipefisher pack` prints without --json. Pure Python."""

from __future__ import annotations

from pipefisher.core.table import format_table
from pipefisher.planning.packing.report import PackResult


def format_pack_report(result: PackResult) -> str:
    """Readable summary of a packing: the cycle, then one row per device; the method's work named
    by its own labels (`WorkLabels`)."""
    data = result.to_dict()
    unit = data["time_unit"]
    first_order = data["first_order_step_time"]
    labels = result.plan.task_rules().labels
    label = labels.method or result.plan.method
    unsplit = "" if data["split"] else f", no {labels.refresh} splitting"
    lines = [
        f"{data['schedule']}: D={data['stages']}, N={data['micro_batches']}, strategy {data['strategy']}"
        f"{unsplit}, {label} task times at percentile {data['percentile']:g}, "
        f"margin {100 * data['margin']:g} %",
        f"refresh interval {data['refresh_steps']} steps (lower bound {data['lower_bound']}); "
        f"bubble utilisation {100 * data['bubble_utilization']:.1f} %",
        f"why: {data['reason']} (plan: {data['placement']})",
        f"frontier{' before the capture cap' if data['memory'] else ''} (k: overhead): "
        + ", ".join(f"{p['refresh_steps']}: {100 * p['overhead']:.2f} %" for p in data["frontier"]),
        f"step time: first-order {first_order:.4g} {unit}, with {labels.precondition} {data['precondition_step_time']:.4g} {unit}, "
        f"with {label} {data['step_time']:.4g} {unit} (packing overhead {100 * data['overhead']:.2f} %)",
    ]
    if data.get("moved_weights"):
        lines.append(
            f"weight gradients (W) moved from where the schedule put them: {data['moved_weights']} over the cycle"
        )
    if result.capture_peak_bytes:
        peak = max(result.capture_peaks, key=lambda p: p.bytes)
        lines.append(
            f"captured activations/gradients held: peak {data['capture_peak_mib']:.1f} MiB (rank {peak.rank}, "
            f"step {peak.step} of the cycle)" + (f"; {data['memory']}" if data["memory"] else "")
        )
    if data["unplaceable"]:
        lines.append(
            f"{len(data['unplaceable'])} tasks fit no bubble and extend steps: {', '.join(data['unplaceable'][:4])}"
            + (" ..." if len(data["unplaceable"]) > 4 else "")
        )
    rows = [
        (
            d["rank"],
            d["refresh_steps"],
            d["lower_bound"],
            f"{d['curvature_work']:.4g}",
            f"{d['precondition_time']:.4g}",
            f"{d['bubble_time']:.4g}",
            "-" if d["work_ratio"] is None else f"{d['work_ratio']:.2f}",
            f"{100 * d['bubble_utilization']:.1f}",
            f"{d['capture_peak_mib']:.1f}",
        )
        for d in data["devices"]
    ]
    headers = [
        "rank",
        "steps used",
        "bound",
        f"{label}/cycle [{unit}]",
        f"{labels.precondition}/step [{unit}]",
        f"bubble/step [{unit}]",
        "work/bubble",
        "util [%]",
        "captures [MiB]",
    ]
    lines.append(format_table(headers, rows))
    plain = data["plain_first_order_step_time"]
    lines.append(
        f"exposed optimizer time: {100 * data['exposed_share']:.2f} % of the first-order step "
        f"(mean step over the cycle, all {label} work included, / first-order step - 1)"
        + (f"; first-order step without {label}'s end-of-step work {plain:.4g} {unit}" if plain != first_order else "")
    )
    after = [(d["rank"], d["precondition_outside"]) for d in data["devices"] if d["precondition_outside"] > 0]
    if after:
        lines.append(
            f"{labels.precondition} with no bubble to go to, run after the step's work "
            f"[{unit}/step]: " + ", ".join(f"rank {rank} {time:.4g}" for rank, time in after)
        )
    return "\n".join(lines)
