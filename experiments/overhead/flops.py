"""Model FLOPs of a training step and the peak dense bf16 rate of the device (`pipefisher.core.peaks`), for MFU.

FLOPs per step = 6 * P * tokens + 12 * L * d * T^2 * sequences, where P counts the weights of the
model's matrix multiplications (every `nn.Linear` and Hugging Face `Conv1D`, the tied MLM/LM
decoder once; embedding lookups and biases excluded), tokens = sequences * T per step, L layers
of width d and T the sequence length: forward 2 FLOPs per multiply-add, backward twice the
forward, and the attention scores and their weighted sum (QK^T and AV, 2 * 2 * T^2 * d a layer
forward) as in the PaLM paper's MFU. Causal masking is not discounted; padding counts as tokens.
"""

from __future__ import annotations

from torch import nn

from pipefisher.config import RunConfig
from pipefisher.core.peaks import peak_flops
from pipefisher.runtime.training import tokens_per_step


def matmul_parameters(module: nn.Module) -> int:
    """Weights of `module`'s matrix multiplications: nn.Linear and transformers' Conv1D, each module once."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")


def layers_and_width(model) -> tuple[int, int]:
    """(transformer layers, hidden size) of a staged BERT or Hugging Face model (`model.config`)."""
    config = model.config
    return config.num_hidden_layers, config.hidden_size


def step_flops(config: RunConfig, model, whole: nn.Module) -> float:
    """Model FLOPs of one training step of `config` (the formula above); `whole` is the one-stage module."""
    layers, width = layers_and_width(model)
    seq_len = config.model.seq_len
    tokens = tokens_per_step(config)
    return 6.0 * matmul_parameters(whole) * tokens + 12.0 * layers * width * seq_len * tokens


def peak_bf16(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of the device called `device_name`; None when the table has none."""
    return peak_flops(device_name, "bfloat16")
