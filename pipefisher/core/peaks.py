"""Published dense peak FLOP/s of known accelerators, per dtype. Pure Python.

Dense rates (NVIDIA's datasheets quote tensor-core rates "with sparsity", twice these): H100 SXM5
and H200 SXM: bfloat16/float16 989 TFLOP/s, TF32 494, float32 67 (no tensor cores), float64 67
(FP64 tensor cores); H100 PCIe: 756, 378, 51, 51; A100 (SXM4 and PCIe, 40 and 80 GB): 312, 156,
19.5, 19.5 (FP64 tensor cores). "tf32" is float32 matrix products on the tensor cores (torch's
``allow_tf32`` / `float32_matmul_precision` "high"). NVL variants are left out (their quoted
figures are per pair of boards or configurable power): a device without an entry has None, and
callers measure it instead.
"""

from __future__ import annotations

#: dtype names a peak is given for
PEAK_DTYPES = ("bfloat16", "float16", "tf32", "float32", "float64")

_H100_SXM = {"bfloat16": 989e12, "float16": 989e12, "tf32": 494e12, "float32": 67e12, "float64": 67e12}
#: dense peak FLOP/s per dtype by a piece of the device name, first match wins (None: known, no entry)
PEAKS: tuple[tuple[str, dict[str, float] | None], ...] = (
    ("H100 PCIe", {"bfloat16": 756e12, "float16": 756e12, "tf32": 378e12, "float32": 51e12, "float64": 51e12}),
    ("H100 NVL", None),
    ("H100", _H100_SXM),
    ("H200 NVL", None),
    ("H200", _H100_SXM),
    ("A100", {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12, "float64": 19.5e12}),
)


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of the device called `device_name` (as torch names it, e.g. "NVIDIA
    H100 80GB HBM3") for `dtype` (one of `PEAK_DTYPES`); None when the table has none."""
    peaks = next((peaks for piece, peaks in PEAKS if piece in device_name), None)
    return None if peaks is None else peaks.get(dtype)
