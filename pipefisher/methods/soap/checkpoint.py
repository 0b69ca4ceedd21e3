"""One SOAP matrix's state as a checkpoint entry (nested dicts of tensors and ints) and back.

Entries written before the first moment moved into the eigenbasis (2026-11-30) hold it in the
original basis and have no ``MOMENTS`` key: loading rotates it in (``Q_Lᵀ m Q_R`` per block)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipefisher.methods.blocks import FACTORS, block_views
from pipefisher.methods.soap.state import MatrixState, pending_numel

#: a factor's optional tensors (absent ones are left out, never None)
SLOTS: tuple[str, ...] = ("snapshot", "basis", "pending")
#: the key, and its value, saying in which basis an entry's first moment is
MOMENTS, EIGENBASIS = "moments", "eigenbasis"


def matrix_state(st: MatrixState) -> dict[str, Any]:
    """Moments, direction count, counters and per factor its statistic and the slots it holds."""
    entry: dict[str, Any] = {
        "exp_avg": st.exp_avg,
        "exp_avg_sq": st.exp_avg_sq,
        "updates": st.updates,
        "counters": st.counters,
        MOMENTS: EIGENBASIS,
    }
    for factor, fs in st.factors.items():
        entry[factor] = {
            "statistic": fs.statistic,
            **{slot: getattr(fs, slot) for slot in SLOTS if getattr(fs, slot) is not None},
        }
    return entry


def load_matrix_state(
    st: MatrixState, entry: dict[str, Any], float_dtype: torch.dtype, statistics_dtype: torch.dtype
) -> None:
    """Restore :func:`matrix_state` output into ``st`` as copies on its parameter's device, the
    statistic and snapshot in ``statistics_dtype``, other floats in ``float_dtype``;
    sizes must match ``st.info`` (ValueError naming the matrix otherwise)."""
    info, device = st.info, st.parameter.device

    def tensor(t: Tensor, numel: int, what: str, dtype: torch.dtype | None) -> Tensor:
        if t.numel() != numel:
            raise ValueError(f"SOAP matrix {info.name!r}: {what} has {t.numel()} elements, want {numel}")
        return t.to(device=device, dtype=dtype or t.dtype, copy=True)

    rows, cols = info.shape
    st.exp_avg = tensor(entry["exp_avg"], rows * cols, "exp_avg", float_dtype).view(info.shape)
    st.exp_avg_sq = tensor(entry["exp_avg_sq"], rows * cols, "exp_avg_sq", float_dtype).view(info.shape)
    st.counters = tensor(entry["counters"], len(st.counters), "counters", None)
    st.updates = int(entry["updates"])
    for factor, fs in st.factors.items():
        slot = entry[factor]
        numel = info.statistic_numel(factor)
        sizes = {"snapshot": numel, "basis": numel, "pending": pending_numel(info, factor)}
        dtypes = {"snapshot": statistics_dtype, "basis": float_dtype, "pending": float_dtype}
        fs.statistic = tensor(slot["statistic"], numel, f"{factor} statistic", statistics_dtype)
        for name in SLOTS:
            setattr(
                fs, name, tensor(slot[name], sizes[name], f"{factor} {name}", dtypes[name]) if name in slot else None
            )
    if entry.get(MOMENTS) != EIGENBASIS and st.started:
        left, right = (block_views(st.factors[f].basis_in_use(), info.block_sizes(f)) for f in FACTORS)
        for k, row_slice, col_slice in info.grid():
            block = st.exp_avg[row_slice, col_slice]
            block.copy_(left[k].mT @ block @ right[k])
