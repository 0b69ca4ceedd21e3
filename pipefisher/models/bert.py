"""BERT for pre-training (masked LM + next-sentence prediction), cut into pipeline stages.

The architecture and the config field names are Hugging Face's (`BertForPreTraining`, post-LN
blocks). Module names are HF's without the leading ``bert.`` and with GLOBAL block indices, so a
stage's names do not depend on the split and the union of all stages' state dicts is the
one-stage model's state dict:

    embeddings.{word_embeddings,position_embeddings,token_type_embeddings,LayerNorm}   stage 0
    encoder.layer.<i>.attention.self.{query,key,value,core}, encoder.layer.<i>.attention.output.dense,
    encoder.layer.<i>.intermediate.dense, encoder.layer.<i>.output.dense (+ .LayerNorm)
    pooler.dense, cls.predictions.transform.{dense,LayerNorm}, cls.predictions.decoder,
    cls.seq_relationship                                                            last stage

HF key = ``"bert." + name`` for ``embeddings``/``encoder``/``pooler``, and ``name`` for ``cls.*``
(HF's ``cls.predictions.bias`` is our ``cls.predictions.decoder.bias``). Every Linear is an
explicit `nn.Linear`, so K-FAC hooks see them all. Each module is initialised (HF's init) from a
generator seeded by (seed, its name) alone, so no parameter depends on the split; the tied
decoder is drawn as ``embeddings.word_embeddings``, so both copies start equal.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pipefisher.core.tensor_parallel import Split, TensorParallelPlan
from pipefisher.core.stage_split import stage_block_ranges
from pipefisher.models import Batch
from pipefisher.models.attention import AttentionCore
from pipefisher.models.init import build_initialised
from pipefisher.models.mlm import at_mlm_positions, mlm_loss

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
WORD_EMBEDDINGS = "embeddings.word_embeddings"
DECODER = "cls.predictions.decoder"


@dataclass(frozen=True)
class BertConfig:
    """BERT hyper-parameters, named as in HF's config.json; defaults are HF's (BERT-Base)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "str" and not isinstance(value, str):
                raise ValueError(f"{field.name}: expected a string, got {value!r}")
            if field.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{field.name}: expected a positive integer, got {value!r}")
            if field.type == "float":
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise ValueError(f"{field.name}: expected a number, got {value!r}")
                object.__setattr__(self, field.name, float(value))
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}: expected a probability in [0, 1), got {getattr(self, name)!r}")
        for name in ("initializer_range", "layer_norm_eps"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"{name}: expected a positive number, got {getattr(self, name)!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act: {self.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads: {self.num_attention_heads} does not divide hidden_size {self.hidden_size}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BertConfig:
        """Config from an HF-style dict: keys this model does not use (architectures, model_type, ...)
        are ignored; a ``position_embedding_type`` other than "absolute" is rejected."""
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type: only 'absolute' is supported, got {d['position_embedding_type']!r}"
            )
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in d.items() if key in names})

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Config from an HF config.json file."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return cls.from_dict(data)


BERT_PRESETS: dict[str, BertConfig] = {
    "bert-base": BertConfig(),
    "bert-large": BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "bert-mini": BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "bert-tiny": BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    # BERT-Tiny's width with 4 layers: the CPU demo, splittable into 2 stages x 2 chunks.
    "bert-4x128": BertConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, intermediate_size=512),
}


def bert_preset(name: str, vocab_size: int | None = None) -> BertConfig:
    """Preset `name` of BERT_PRESETS, with its vocabulary size replaced when `vocab_size` is given."""
    if name not in BERT_PRESETS:
        raise ValueError(f"preset: {name!r} is not one of {', '.join(BERT_PRESETS)}")
    preset = BERT_PRESETS[name]
    return preset if vocab_size is None else dataclasses.replace(preset, vocab_size=vocab_size)


class Embeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout: (B, T) ids -> (B, T, hidden)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.LayerNorm(x))


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product attention over the unpadded keys, before the output projection."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.head_size = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.core = AttentionCore(config.attention_probs_dropout_prob)

    def forward(self, x: Tensor, keep: Tensor | None) -> Tensor:
        """x: (B, T, hidden); keep: (B, 1, 1, T) bool, True = attend to that key, or None (attend to
        every key: no mask, so SDPA may take its flash kernel). Returns (B, T, width of the
        projections): hidden, or a tensor-parallel shard's heads only."""
        batch, seq, _ = x.shape
        split = lambda t: t.view(batch, seq, -1, self.head_size).transpose(1, 2)
        attended = self.core(split(self.query(x)), split(self.key(x)), split(self.value(x)), keep)
        return attended.transpose(1, 2).flatten(2)


class AddNorm(nn.Module):
    """Post-LN residual: LayerNorm(residual + dropout(dense(x)))."""

    def __init__(self, config: BertConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(residual + self.dropout(self.dense(x)))


class Attention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = SelfAttention(config)
        self.output = AddNorm(config, config.hidden_size)

    def forward(self, x: Tensor, keep: Tensor | None) -> Tensor:
        return self.output(self.self(x, keep), x)


class DenseAct(nn.Module):
    """act(dense(x)): the FFN's first layer."""

    def __init__(self, config: BertConfig, out_features: int):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, out_features)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    """One BERT encoder block: (B, T, hidden) -> (B, T, hidden)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = Attention(config)
        self.intermediate = DenseAct(config, config.intermediate_size)
        self.output = AddNorm(config, config.intermediate_size)

    def forward(self, x: Tensor, keep: Tensor | None) -> Tensor:
        x = self.attention(x, keep)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    """Consecutive encoder blocks, keyed by their global index."""

    def __init__(self, config: BertConfig, blocks: range):
        super().__init__()
        self.layer = nn.ModuleDict({str(i): Layer(config) for i in blocks})

    def forward(self, x: Tensor, keep: Tensor | None) -> Tensor:
        for block in self.layer.values():
            x = block(x, keep)
        return x


class Pooler(nn.Module):
    """tanh(dense(hidden state of [CLS])): (B, T, hidden) -> (B, hidden)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class Transform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class Predictions(nn.Module):
    """MLM head: decoder(transform(x)), (B, P, hidden) -> (B, P, vocab); decoder.weight is tied."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = Transform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.transform(x))


class Heads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = Predictions(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertStage(nn.Module):
    """Blocks `blocks` of BERT; stage 0 embeds, the last stage applies the pooler and both heads.

    forward(x, batch): x (B, T, hidden) from the previous stage (None on stage 0, which reads
    batch["input_ids"], batch["token_type_ids"]); batch["attention_mask"] (B, T), 1 = token, 0 = pad,
    absent when no sequence is padded (then attention takes no mask). Returns hidden states
    (B, T, hidden), or on the last stage (mlm_logits (B, P, vocab), nsp_logits (B, 2)): the MLM head
    runs on batch["mlm_positions"] (B, P) only, or on all P = T positions without it
    (`pipefisher.models.mlm`).
    """

    def __init__(self, config: BertConfig, blocks: range, first: bool, last: bool):
        super().__init__()
        self.embeddings = Embeddings(config) if first else None
        self.encoder = Encoder(config, blocks)
        self.pooler = Pooler(config) if last else None
        self.cls = Heads(config) if last else None

    def forward(self, x: Tensor | None, batch: dict[str, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        if self.embeddings is not None:
            x = self.embeddings(batch["input_ids"], batch["token_type_ids"])
        if x is None:
            raise ValueError("x: a stage without embeddings needs the previous stage's hidden states")
        mask = batch.get("attention_mask")
        x = self.encoder(x, None if mask is None else mask[:, None, None, :].bool())
        if self.cls is None or self.pooler is None:
            return x
        return self.cls.predictions(at_mlm_positions(x, batch)), self.cls.seq_relationship(self.pooler(x))


def hf_init(module: nn.Module, generator: torch.Generator, std: float) -> None:
    """HF's init drawn from `generator`: Linear/Embedding weight ~ N(0, std) (drawn first, so a
    decoder drawn as its word embedding equals it), biases 0; LayerNorm weight 1, bias 0."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.normal_(0.0, std, generator=generator)
    elif isinstance(module, nn.LayerNorm):
        module.weight.fill_(1.0)
    else:
        raise TypeError(f"no initialisation for {type(module).__name__}")
    if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
        module.bias.zero_()


class BertStagedModel:
    """BERT pre-training model for a pipeline runtime: builds stages, gives shapes and the loss."""

    #: named parts of `loss` the run reports
    loss_parts: tuple[str, ...] = ("mlm", "nsp")

    def __init__(self, config: BertConfig, seq_len: int, stage_blocks: tuple[int, ...] = ()):
        if not 1 <= seq_len <= config.max_position_embeddings:
            raise ValueError(
                f"seq_len: expected 1..{config.max_position_embeddings} (max_position_embeddings), got {seq_len}"
            )
        self.config = config
        self.seq_len = seq_len
        self.stage_blocks = stage_blocks

    def build_stage(self, index: int, num_stages: int, seed: int) -> BertStage:
        """Stage `index` of `num_stages` (blocks split evenly, or `stage_blocks` per stage); each parameter depends on (seed, its
        global name) alone, the tied decoder weight equals the word embedding. With one stage the
        decoder weight is the word-embedding Parameter itself. Does not touch the global RNG."""
        layers = self.config.num_hidden_layers
        if not 0 <= index < num_stages:
            raise ValueError(f"index: expected 0..{num_stages - 1}, got {index}")
        blocks = stage_block_ranges(layers, num_stages, self.stage_blocks)[index]
        stage = build_initialised(
            lambda: BertStage(self.config, blocks, index == 0, index == num_stages - 1),
            seed,
            functools.partial(hf_init, std=self.config.initializer_range),
            drawn_as={DECODER: WORD_EMBEDDINGS},
        )
        if stage.embeddings is not None and stage.cls is not None:
            stage.cls.predictions.decoder.weight = stage.embeddings.word_embeddings.weight
        return stage

    def activation_shape(self, stage: int, num_stages: int, micro_batch_size: int) -> tuple[int, ...]:
        """Shape (micro_batch_size, seq_len, hidden) of what stage `stage` sends to stage + 1."""
        if not 0 <= stage < num_stages - 1:
            raise ValueError(f"stage: expected 0..{num_stages - 2} (the last stage sends nothing), got {stage}")
        return (micro_batch_size, self.seq_len, self.config.hidden_size)

    def loss(self, output: tuple[Tensor, Tensor], batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """MLM cross-entropy, mean over positions with batch["mlm_labels"] != -100 (0 if there are
        none; `pipefisher.models.mlm.mlm_loss`), plus NSP cross-entropy, mean over the micro-batch
        (batch["nsp_labels"], (B,)). Returns (total, {"mlm": detached, "nsp": detached})."""
        mlm_logits, nsp_logits = output
        mlm = mlm_loss(mlm_logits, batch)
        nsp = F.cross_entropy(nsp_logits, batch["nsp_labels"])
        return mlm + nsp, {"mlm": mlm.detach(), "nsp": nsp.detach()}

    def tied_parameters(self) -> list[tuple[str, str]]:
        """The tied weight's copies as (stage, parameter name), stage "first" or "last"; the runtime
        sums their gradients. With one stage both names resolve to the same Parameter."""
        return [("first", f"{WORD_EMBEDDINGS}.weight"), ("last", f"{DECODER}.weight")]

    def first_order_linears(self) -> tuple[str, ...]:
        """Glob patterns of Linear module names that K-FAC leaves first-order: the tied decoder."""
        return (DECODER,)

    def tensor_parallel_plan(self, degree: int) -> TensorParallelPlan:
        """Megatron's split of every encoder block (`pipefisher.core.tensor_parallel`); ValueError
        naming the field `degree` does not divide. Embeddings, pooler and heads stay whole: the
        decoder is tied to the word embedding of the first stage, and a vocabulary split would
        need a cross-entropy over vocabulary shards."""
        for name in ("num_attention_heads", "intermediate_size"):
            if getattr(self.config, name) % degree:
                raise ValueError(
                    f"{name}: {getattr(self.config, name)} is not divisible by pipeline.tensor_parallel {degree}"
                )
        block = "encoder.layer.*."
        return {f"{block}attention.self.{name}": Split.COLUMN for name in ("query", "key", "value")} | {
            f"{block}attention.output.dense": Split.ROW,
            f"{block}intermediate.dense": Split.COLUMN,
            f"{block}output.dense": Split.ROW,
        }

    def recompute_plan(self, mode: str) -> tuple[str, ...]:
        """Modules `model.recompute` `mode` checkpoints: every encoder block, or (selective)
        every block's attention core."""
        return {"none": (), "blocks": ("encoder.layer.*",), "selective": ("encoder.layer.*.attention.self.core",)}[mode]
