"""The profiler's flop counts of a rank's layers and the device rates they compare with
(`pipefisher.runtime.training.task_flops`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pipefisher.config import load_config
from pipefisher.core.peaks import peak_flops
from pipefisher.methods.flops import MatrixShape
from pipefisher.methods.registry import method
from pipefisher.runtime.training.task_flops import flop_rates, layer_flops, matrix_shape, work_dtypes
from pipefisher.testing.harness import method_inputs

TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"


class Conv1D(nn.Module):
    """Hugging Face's linear map (weight stored (in, out)), recognised by its class name."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(d_out))


def test_a_task_names_a_linear_module_or_a_parameter():
    model = nn.ModuleDict({"fc": nn.Linear(6, 4), "conv": Conv1D(6, 4), "norm": nn.LayerNorm(4)}).double()
    assert matrix_shape(model, "fc") == MatrixShape(4, 6, True, "float64")
    assert matrix_shape(model, "conv") == MatrixShape(4, 6, True, "float64"), "Conv1D maps in -> out"
    assert matrix_shape(model, "fc.weight") == MatrixShape(4, 6, False, "float64")
    assert matrix_shape(model, "conv.weight") == MatrixShape(6, 4, False, "float64"), "a parameter as stored"
    assert matrix_shape(model, "norm") is None and matrix_shape(model, "norm.weight") is None
    assert matrix_shape(model, "missing") is None


def test_the_timers_layers_get_their_methods_counts():
    config = load_config(TINY).with_overrides(optimizer={"name": "muon"})
    parts = method("muon").runtime_parts()
    module = nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3))
    timer = parts.timer(method_inputs(config), {(0, 1): module}, ())
    counts = layer_flops(timer, {(0, 1): module}, [(1, "0.weight"), (1, "2.weight"), (1, "0.bias")])
    tokens = config.data.micro_batch_size * config.model.seq_len
    assert counts == {
        (1, "0.weight"): method("muon").task_flops(config.muon, MatrixShape(5, 8), tokens),
        (1, "2.weight"): method("muon").task_flops(config.muon, MatrixShape(3, 5), tokens),
    }
    assert work_dtypes(counts.values(), torch.device("cpu")) == {"precondition": "float32"}


def test_a_known_device_takes_its_peaks_and_another_is_measured():
    cpu = torch.device("cpu")
    known = flop_rates(cpu, "NVIDIA H100 80GB HBM3", {"refresh": "float64", "curvature": "bfloat16"})
    assert not known.measured and dict(known.peaks) == {"bfloat16": 989e12, "float64": 67e12}
    assert dict(known.dtypes) == {"refresh": "float64", "curvature": "bfloat16"}
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12 and peak_flops("NVIDIA H200 NVL", "float32") is None
    measured = flop_rates(cpu, "a CPU", {"refresh": "float64", "precondition": "float32"})
    assert measured.measured and set(measured.peaks) == {"float32", "float64"}
    assert all(rate > 0 for rate in measured.peaks.values())
