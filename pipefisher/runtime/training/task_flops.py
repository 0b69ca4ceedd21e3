"""The flops of the method's tasks on a rank's layers and the device's rates they compare with,
for the profiler (`pipefisher.core.profile_flops`).

A task's name (a layer's, as the method's timer gives it) is a linear module of the stage (K-FAC)
or a parameter (Shampoo, SOAP, Muon: the weight's name); its `MatrixShape` comes from the module,
and the method's hook (`CurvatureMethod.task_flops`) counts it. The device's rate per dtype is its
published dense peak (`pipefisher.core.peaks`) where the table knows the device, else the rate of
a large matrix product timed on it (median of a few), marked `FlopRates.measured`.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from pipefisher.core.peaks import peak_flops
from pipefisher.core.profile_flops import FlopRates
from pipefisher.methods.dtypes import dtype_name, torch_dtype
from pipefisher.methods.flops import MatrixShape, TaskFlops
from pipefisher.runtime.primitives.tf32 import tf32_enabled
from pipefisher.methods.interface import TaskTimer
from pipefisher.methods.layers import linear_info
from pipefisher.methods.registry import methods
from pipefisher.runtime.primitives.clock import timed_ms

#: side of the square product that measures a device's rate, by device type (others: the CPU's)
MATMUL_SIDE = {"cuda": 4096, "cpu": 512}


def matrix_shape(module: nn.Module, name: str) -> MatrixShape | None:
    """The matrix the task named `name` acts on in the stage `module`: a linear module of that
    name (rows = out_features, cols = in_features), else a parameter (its first dimension by the
    rest); None for neither."""
    found = dict(module.named_modules()).get(name)
    info = linear_info(name, found) if found is not None else None
    if info is not None:
        dtype = dtype_name(found.weight.dtype)  # type: ignore[union-attr]
        return MatrixShape(info.out_features, info.in_features, info.has_bias, dtype)
    parameter = dict(module.named_parameters()).get(name)
    if parameter is None or parameter.dim() < 2:
        return None
    return MatrixShape(parameter.shape[0], math.prod(parameter.shape[1:]), dtype=dtype_name(parameter.dtype))


def layer_flops(
    timer: TaskTimer, modules: Mapping[tuple[int, int], nn.Module], layers: Iterable[tuple[int, str]]
) -> dict[tuple[int, str], dict[str, TaskFlops]]:
    """(stage, layer) -> time key -> the flops of that task, for the `layers` the `timer` measured
    on this rank's `modules` ((pipe, stage) -> module); {} when the method declares no counts or
    the timer has no `config`."""
    method = methods().get(timer.method)
    if method is None or timer.config is None:
        return {}
    settings, sequences = timer.config.settings, timer.config.micro_batch_size
    tokens = sequences * timer.config.seq_len
    by_stage = {stage: module for (_, stage), module in modules.items()}
    found: dict[tuple[int, str], dict[str, TaskFlops]] = {}
    for stage, layer in layers:
        shape = matrix_shape(by_stage[stage], layer) if stage in by_stage else None
        counts = method.task_flops(settings, shape, tokens, sequences) if shape is not None else {}
        if counts:
            found[(stage, layer)] = counts
    return found


def math_dtype(dtype: str, device: torch.device) -> str:
    """The dtype a matrix product in `dtype` runs in on `device`: "tf32" for float32 on CUDA
    with TF32 products allowed, else `dtype`."""
    if dtype == "float32" and device.type == "cuda" and tf32_enabled():
        return "tf32"
    return dtype


@functools.cache
def matmul_rate(dtype: str, device: torch.device, repeats: int = 3) -> float:
    """FLOP/s of a square product of `MATMUL_SIDE` on `device` in `dtype` (a math dtype: "tf32"
    times float32 as the device runs it), the median of `repeats` after one warm-up; measured
    once per process (a re-profiling run reuses it)."""
    n = MATMUL_SIDE.get(device.type, MATMUL_SIDE["cpu"])
    left = torch.randn(n, n, device=device, dtype=torch_dtype("float32" if dtype == "tf32" else dtype))
    right = torch.randn_like(left)
    samples = timed_ms(lambda: left @ right, device, repeats + 1)[1:]
    return 2.0 * n**3 / (statistics.median(samples) / 1000)


def flop_rates(device: torch.device, name: str, dtypes: Mapping[str, str]) -> FlopRates:
    """The rates the tasks' work (work -> math dtype) compare with on `device` called `name`:
    the published peaks where the table has each dtype, else each measured (`matmul_rate`)."""
    wanted = sorted(set(dtypes.values()))
    peaks = {dtype: peak for dtype in wanted if (peak := peak_flops(name, dtype)) is not None}
    if len(peaks) == len(wanted):
        return FlopRates(dtypes, peaks)
    return FlopRates(dtypes, {dtype: matmul_rate(dtype, device) for dtype in wanted}, measured=True)


def work_dtypes(counts: Iterable[Mapping[str, TaskFlops]], device: torch.device) -> dict[str, str]:
    """work ("refresh") -> the math dtype its tasks run in on `device` (the first count's)."""
    found: dict[str, str] = {}
    for layer in counts:
        for key, task in layer.items():
            found.setdefault(key.partition(".")[0], math_dtype(task.dtype, device))
    return found
