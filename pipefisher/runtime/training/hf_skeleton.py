"""A Hugging Face staged model from the `model` section alone (no data, no run): what a run builds
with its tokenizer's overrides (`model_builders.hf_model`) and what a run asks before its data
exists (the model's objective, `assembly.data_objective`)."""

from __future__ import annotations

from pipefisher.config import ConfigError, ModelConfig


def hf_staged(
    settings: ModelConfig, overrides: tuple[tuple[str, object], ...] = (), stage_blocks: tuple[int, ...] = ()
):
    """The Hugging Face staged model of `settings` with `overrides` of its config, its stages
    holding `stage_blocks` blocks each when given (`pipeline.stage_blocks`) (building the
    skeleton of a large model takes seconds: a run builds it through its `RunParts`, once);
    ConfigError naming the key."""
    try:
        from pipefisher.models.hf import DROPOUT_FIELDS, HfStagedModel, load_hf_config
    except ImportError:
        raise ConfigError('model.kind hf needs Hugging Face transformers: pip install -e ".[hf]"') from None
    try:
        hf_config = load_hf_config(settings.hf_config, **dict(overrides))
        if settings.dropout >= 0:
            for name in DROPOUT_FIELDS:
                if hasattr(hf_config, name):
                    setattr(hf_config, name, settings.dropout)
        class_name = settings.hf_class or (getattr(hf_config, "architectures", None) or [""])[0]
        if not class_name:
            raise ValueError("hf_class: the config names no architectures; set model.hf_class (e.g. GPT2LMHeadModel)")
        return HfStagedModel(class_name, hf_config, settings.seq_len, settings.hf_weights, stage_blocks)
    except ValueError as exc:
        # every message names its field (hf_config, hf_class, hf_weights, seq_len)
        raise ConfigError(f"model.{exc}") from None
