"""One Shampoo matrix's state as a checkpoint entry (nested dicts of tensors) and back."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipefisher.methods.shampoo.state import FactorState, MatrixState, Roots

ROOT_SLOTS: tuple[str, ...] = ("pending", "committed")


def matrix_state(st: MatrixState) -> dict[str, Any]:
    """Statistics, pending and committed roots with their flags, counters per factor, and the
    captured gradient when one is held (absent slots are left out, never None)."""
    entry: dict[str, Any] = {}
    for factor, fs in st.factors.items():
        slot: dict[str, Any] = {"statistic": fs.statistic, "counters": fs.counters}
        for name in ROOT_SLOTS:
            roots: Roots | None = getattr(fs, name)
            if roots is not None:
                slot[name] = {"value": roots.value, "ok": roots.ok}
        entry[factor] = slot
    if st.captured is not None:
        entry["captured"] = st.captured
    return entry


def load_matrix_state(
    st: MatrixState, entry: dict[str, Any], dtype: torch.dtype, statistics_dtype: torch.dtype
) -> None:
    """Restore :func:`matrix_state` output into ``st`` as copies on its parameter's device,
    statistics in ``statistics_dtype``, other floats in ``dtype``; sizes must
    match ``st.info`` (ValueError naming the matrix otherwise)."""
    info, device = st.info, st.parameter.device

    def tensor(t: Tensor, numel: int, what: str, float_dtype: torch.dtype | None = dtype) -> Tensor:
        if t.numel() != numel:
            raise ValueError(f"Shampoo matrix {info.name!r}: {what} has {t.numel()} elements, want {numel}")
        return t.to(device=device, dtype=float_dtype or t.dtype, copy=True)

    for factor in st.factors:
        slot = entry[factor]
        numel = info.statistic_numel(factor)
        fs = FactorState(
            tensor(slot["statistic"], numel, f"{factor} statistic", statistics_dtype),
            tensor(slot["counters"], len(st.factors[factor].counters), "counters", None),
        )
        for name in ROOT_SLOTS:
            if name in slot:
                roots = Roots(
                    tensor(slot[name]["value"], numel, f"{factor} {name} roots"),
                    tensor(slot[name]["ok"], info.num_blocks, f"{factor} {name} flags", None),
                )
                setattr(fs, name, roots)
        st.factors[factor] = fs
    captured = entry.get("captured")
    st.captured = (
        None if captured is None else tensor(captured, info.gradient_numel, "captured gradient").view(info.shape)
    )
