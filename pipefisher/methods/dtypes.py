"""The float dtypes of the methods' engines: the torch dtype a run-file dtype name (e.g. a
`StatisticsDtype`) stands for, and the check of the working dtype Shampoo and SOAP accept."""

from __future__ import annotations

import torch

#: the working dtypes of Shampoo's and SOAP's state (roots, eigenbases, moments, grafting)
WORKING_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named `name` ("float32" -> torch.float32); ValueError for another name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """`dtype` when it is one of `WORKING_DTYPES` (ValueError naming it otherwise)."""
    if dtype not in WORKING_DTYPES:
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name a run file gives `dtype` (torch.float64 -> "float64"), the inverse of `torch_dtype`."""
    return str(dtype).removeprefix("torch.")
