"""The planner's outputs: the ranked table with a reason per row, JSON, and the best layout
written back as a run file. Pure Python: no torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from pipefisher.config import config_from_dict
from pipefisher.core.table import format_table
from pipefisher.planning.planner.candidates import Layout
from pipefisher.planning.planner.predict import Prediction, is_curvature

GiB = 2**30


def _parts(prediction: Prediction) -> dict[str, float]:
    """Where a step's time goes (ms): idle bubble, the method's overhead (its refresh and per-step
    work), the rest."""
    bubble = prediction.first_order_ms * prediction.bubble_share
    return {
        "bubble": bubble,
        "method overhead": prediction.step_ms - prediction.first_order_ms,
        "work": prediction.first_order_ms - bubble,
    }


def why(prediction: Prediction, best: Prediction, budget: int) -> str:
    """Why `prediction` ranks where it does: for the best, its bubble, overhead and headroom; for
    another, the part of the step that costs it most against the best."""
    headroom = (budget - prediction.memory.total) / GiB
    if prediction is best:
        k = (
            f", k={prediction.layout.refresh_steps} adds {100 * prediction.overhead_share:.1f} %"
            if is_curvature(prediction.layout.method)
            else ""
        )
        return f"fastest: bubble {100 * prediction.bubble_share:.0f} %{k}; {headroom:.1f} GiB free"
    mine, theirs = _parts(prediction), _parts(best)
    name, extra = max(((key, mine[key] - theirs[key]) for key in mine), key=lambda item: item[1])
    detail = {
        "bubble": f"bubble {100 * prediction.bubble_share:.1f} % vs {100 * best.bubble_share:.1f} %",
        "method overhead": f"method adds {100 * prediction.overhead_share:.1f} % (k={prediction.layout.refresh_steps})",
        "work": f"busy {mine['work']:.0f} ms vs {theirs['work']:.0f} ms per device"
        + (f" (recompute {prediction.layout.recompute})" if prediction.layout.recompute != "none" else ""),
    }[name]
    return f"+{prediction.step_ms - best.step_ms:.0f} ms: {detail}"


def _gradient_path(layout: Layout) -> str:
    return (
        f"ZeRO-{layout.zero}" if layout.zero else f"PowerSGD r{layout.powersgd_rank}" if layout.powersgd_rank else "-"
    )


def ranked_table(predictions: Sequence[Prediction], budget: int, top: int = 10) -> str:
    """The first `top` predictions as a table (units in the headers)."""
    best = predictions[0]
    headers = [
        "#",
        "layout",
        "recompute",
        "grad path",
        "method (k)",
        "step [ms]",
        "first-order [ms]",
        "tokens/s",
        "bubble [%]",
        "reduce [ms]",
        "memory [GiB]",
        "state/act/capt [GiB]",
        "why",
    ]
    rows = []
    for place, p in enumerate(predictions[:top], 1):
        memory = p.memory
        method = f"{p.layout.method} ({p.layout.refresh_steps})" if is_curvature(p.layout.method) else p.layout.method
        rows.append(
            [
                place,
                p.layout.describe(),
                p.layout.recompute,
                _gradient_path(p.layout),
                method,
                f"{p.step_ms:.1f}",
                f"{p.first_order_ms:.1f}",
                f"{p.tokens_per_s:,.0f}",
                f"{100 * p.bubble_share:.1f}",
                f"{p.reduce_ms:.1f}",
                f"{memory.total / GiB:.2f}",
                f"{memory.state / GiB:.2f}/{memory.activations / GiB:.2f}/{memory.captures / GiB:.2f}",
                why(p, best, budget),
            ]
        )
    return format_table(headers, rows)


def prediction_dict(prediction: Prediction) -> dict[str, Any]:
    """One prediction as JSON-ready data (times in ms, memory in bytes)."""
    layout = prediction.layout
    return {
        "layout": {key: getattr(layout, key) for key in layout.__dataclass_fields__},
        "step_ms": prediction.step_ms,
        "first_order_ms": prediction.first_order_ms,
        "samples_per_s": prediction.samples_per_s,
        "tokens_per_s": prediction.tokens_per_s,
        "bubble_share": prediction.bubble_share,
        "overhead_share": prediction.overhead_share,
        "exposed_share": prediction.overhead_share,
        "reduce_ms": prediction.reduce_ms,
        "memory_bytes": {
            "total": prediction.memory.total,
            "state": prediction.memory.state,
            "activations": prediction.memory.activations,
            "captures": prediction.memory.captures,
            "rank": prediction.memory.rank,
        },
        "reason": prediction.reason,
    }


def run_file_of(raw: dict[str, Any], layout: Layout) -> str:
    """The run file `raw` (as its YAML parsed) with the layout's pipeline (its stage split included), micro-batch size,
    optimizer, ZeRO-1, PowerSGD, refresh interval and recomputation set; checked by the config
    loader (ConfigError if it does not load)."""
    data = {section: dict(values or {}) for section, values in raw.items()}
    data.setdefault("pipeline", {}).update(
        schedule=layout.schedule,
        stages=layout.stages,
        micro_batches=layout.micro_batches,
        data_parallel=layout.data_parallel,
        tensor_parallel=layout.tensor_parallel,
    )
    if layout.schedule == "interleaved":
        data["pipeline"]["chunks"] = layout.chunks
    else:
        data["pipeline"].pop("chunks", None)
    if layout.stage_blocks:
        data["pipeline"]["stage_blocks"] = list(layout.stage_blocks)
    else:
        data["pipeline"].pop("stage_blocks", None)
    data.setdefault("data", {})["micro_batch_size"] = layout.micro_batch_size
    data.setdefault("optimizer", {}).update(name=layout.method, zero=int(layout.zero))
    data.setdefault("comm", {})["powersgd_rank"] = layout.powersgd_rank
    if is_curvature(layout.method):
        data.setdefault(layout.method, {})["refresh_steps"] = layout.refresh_steps
    data.setdefault("model", {})["recompute"] = layout.recompute
    config_from_dict(data)
    return yaml.safe_dump(data, sort_keys=False)
