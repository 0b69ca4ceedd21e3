"""One K-FAC layer's state as a checkpoint entry (tensors, numbers and bools) and back."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from pipefisher.methods.kfac.layer import BuiltFactor, Factor, Flagged, LayerState


def layer_state(st: LayerState) -> dict[str, Any]:
    """Everything of ``st`` but its module: factors, inverses with their validity flags,
    captures with their loss scales, health counters."""
    return {
        "ema": _flagged(st.ema),
        "pending": _flagged(st.pending),
        "active": _flagged(st.active),
        "built": {f: asdict(b) for f, b in st.built.items()},
        "captures": {f: {mb: list(ts) for mb, ts in store.items()} for f, store in st.captures.items()},
        "loss_scales": dict(st.loss_scales),
        "counters": dict(st.counters),
    }


def load_layer_state(st: LayerState, entry: dict[str, Any]) -> None:
    """Restore :func:`layer_state` output into ``st`` on its module's device (copies); factor
    matrices must have ``st``'s sizes (ValueError otherwise)."""
    device = st.weight.device

    def matrix(t: Tensor, factor: Factor) -> Tensor:
        n = st.info.size(factor)
        if tuple(t.shape) != (n, n):
            raise ValueError(f"layer {st.info.name!r}: {factor} has shape {tuple(t.shape)}, want {(n, n)}")
        return t.to(device=device, dtype=st.dtype).clone()

    def flagged(slots: dict[Factor, dict[str, Tensor]]) -> dict[Factor, Flagged]:
        return {f: Flagged(matrix(s["value"], f), s["ok"].to(device).clone()) for f, s in slots.items()}

    st.ema, st.pending, st.active = (flagged(entry[key]) for key in ("ema", "pending", "active"))
    st.built = {
        f: BuiltFactor(matrix(b["total"], f), int(b["rows"]), bool(b["sealed"]), _to(b["count"], device))
        for f, b in entry["built"].items()
    }
    st.captures = {
        f: {mb: [t.to(device) for t in ts] for mb, ts in store.items()} for f, store in entry["captures"].items()
    }
    st.loss_scales = {mb: _to(scale, device) for mb, scale in entry["loss_scales"].items()}
    st.counters = {f: c.to(device).clone() for f, c in entry["counters"].items()}


def _flagged(slots: dict[Factor, Flagged]) -> dict[Factor, dict[str, Tensor]]:
    return {f: {"value": s.value, "ok": s.ok} for f, s in slots.items()}


def _to(value: Any, device: torch.device) -> Any:
    """A tensor copied to ``device``; anything else (a number, None) as is."""
    return value.to(device).clone() if isinstance(value, Tensor) else value
