"""The run file's `model` section: the model and how it is cut into stages, each key declared once
(type, default, range, one line of documentation). Pure Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipefisher.core.names import Recompute
from pipefisher.core.settings import setting
from pipefisher.models.registry import model_kind

#: the BERT presets of `pipefisher.models.bert.BERT_PRESETS` (a test holds the two to the same names)
BertPreset = Literal["bert-tiny", "bert-mini", "bert-4x128", "bert-base", "bert-large"]


@dataclass(frozen=True)
class ModelConfig:
    """The model and how it is cut into stages."""

    kind: str = setting(
        "transformer",
        "a kind of `pipefisher.models.registry`: transformer/mlp: a small regression model; bert: BERT pretraining "
        "(MLM + NSP); hf: a Hugging Face model (the hf extra)",
    )
    preset: BertPreset = setting("bert-tiny", "bert: the size of the model (`pipefisher.models.bert.BERT_PRESETS`)")
    config_json: str = setting("", 'a Hugging Face BERT config.json instead of the preset ("" = the preset)')
    hf_config: str = setting(
        "gpt2-tiny",
        "hf: a config.json path, or a config shipped with pipefisher (gpt2-tiny, bert-tiny, llama-tiny, gpt2-medium, gpt2)",
    )
    hf_class: str = setting("", 'hf: the transformers class ("" = the config\'s first `architectures` entry)')
    hf_weights: str = setting("", 'hf: a safetensors file to load the weights from ("" = initialise)')
    dropout: float = setting(
        -1.0,
        "dropout probability of bert/hf models",
        low=0,
        high=1,
        high_open=True,
        special=(-1.0,),
        note="-1 = the config's own",
    )
    layers: int = setting(4, "transformer/mlp: blocks (split evenly over the stages)", low=0, low_open=True)
    hidden: int = setting(32, "transformer/mlp: width of a block", low=0, low_open=True)
    heads: int = setting(2, "transformer: attention heads (divides hidden)", low=0, low_open=True)
    ffn: int = setting(64, "transformer: feed-forward width", low=0, low_open=True)
    seq_len: int = setting(8, "tokens per sequence (every kind)", low=0, low_open=True)
    input_dim: int = setting(16, "transformer/mlp: features per input token", low=0, low_open=True)
    output_dim: int = setting(4, "transformer/mlp: regression targets per token", low=0, low_open=True)
    recompute: Recompute = setting(
        "none",
        "activation recomputation: blocks keeps each block's input and recomputes its inside in the backward; "
        "selective only the attention core (scores, softmax, dropout); none keeps everything",
    )

    @property
    def identity(self) -> str:
        """The model in one line, as a profile records what it measured (its `model`): "bert
        bert-base", "hf gpt2-tiny", "transformer layers 4 hidden 32 heads 2 ffn 64", ...; files
        by their name. Two runs of one identity time alike per micro-batch of one shape."""
        return model_kind(self.kind).identity(self)
