"""The trainable state of pipefisher's BERT (`pipefisher.models.bert`) per pipeline stage, as the
memory model takes it (`pipefisher.planning.memory.state.StageState`), at a tensor-parallel degree T.
Pure Python: no torch.

At T > 1 the stage is the one tensor-parallel rank `index` holds: the six Linear layers of each
block are its shards (`pipefisher.core.tensor_parallel.BLOCK_SPLITS`: column-split weights
(out/T x in) with their bias slice, row-split weights (out x in/T) with the bias on shard 0 only);
everything else (embeddings, LayerNorms, pooler and heads) is replicated, whole on every rank.
Shard 0 holds the most (the row-split biases), so it is the rank a memory bound should read.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipefisher.core.stage_split import stage_block_ranges
from pipefisher.core.tensor_parallel import BLOCK_SPLITS, Split, holds_bias, shard_features
from pipefisher.planning.memory.layer_model import CurvatureLayer
from pipefisher.planning.memory.state import StageState
from pipefisher.planning.transformer_profile import BLOCK_LAYERS

#: a curvature method's memory model of one Linear layer: (module name, inputs, outputs, whether
#: the rank holds its bias) -> its `CurvatureLayer`
LinearModel = Callable[[str, int, int, bool], CurvatureLayer]

#: module path inside pipefisher's BERT block of each `BLOCK_LAYERS` name
BLOCK_MODULES = dict(
    zip(
        BLOCK_LAYERS,
        (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
            "intermediate.dense",
            "output.dense",
        ),
    )
)
#: the Linear layers curvature methods leave first-order in pipefisher's BERT (the tied decoder)
FIRST_ORDER = ("cls.predictions.decoder",)


@dataclass(frozen=True)
class TransformerSizes:
    """A BERT model's sizes (`pipefisher.models.bert.BertConfig`'s names in short)."""

    blocks: int
    hidden: int
    ffn: int
    vocab: int
    max_positions: int = 512
    type_vocab: int = 2


@dataclass(frozen=True)
class _Tensor:
    """One parameter: its module, shape, and the Linear it belongs to (inputs, outputs, has bias) or None."""

    module: str
    shape: tuple[int, ...]
    linear: tuple[int, int, bool] | None = None


def _linear(module: str, inputs: int, outputs: int, split: Split | None, degree: int, index: int) -> list[_Tensor]:
    shard_in, shard_out = shard_features(inputs, outputs, split, degree)
    bias = holds_bias(split, index)
    linear = (shard_in, shard_out, bias)
    return [_Tensor(module, (shard_out, shard_in), linear)] + ([_Tensor(module, (shard_out,), linear)] if bias else [])


def _norm(module: str, hidden: int) -> list[_Tensor]:
    return [_Tensor(module, (hidden,)), _Tensor(module, (hidden,))]


def _block(sizes: TransformerSizes, block: int, degree: int, index: int) -> list[_Tensor]:
    h, f = sizes.hidden, sizes.ffn
    shapes = dict(zip(BLOCK_LAYERS, [(h, h)] * 4 + [(h, f), (f, h)]))
    prefix = f"encoder.layer.{block}"

    def linear(name: str) -> list[_Tensor]:
        return _linear(f"{prefix}.{BLOCK_MODULES[name]}", *shapes[name], BLOCK_SPLITS[name], degree, index)

    attention = [t for name in BLOCK_LAYERS[:4] for t in linear(name)] + _norm(
        f"{prefix}.attention.output.LayerNorm", h
    )
    return attention + linear("intermediate") + linear("output") + _norm(f"{prefix}.output.LayerNorm", h)


def _stage_tensors(
    sizes: TransformerSizes, stage: int, held: range, num_stages: int, degree: int, index: int
) -> list[_Tensor]:
    """The parameters of stage `stage` (holding blocks `held`) in `module.parameters()` order, each
    tensor once (with one stage the decoder's weight is the word embedding's)."""
    h = sizes.hidden
    first, last = stage == 0, stage == num_stages - 1
    tensors: list[_Tensor] = []
    if first:
        tensors += [
            _Tensor("embeddings.word_embeddings", (sizes.vocab, h)),
            _Tensor("embeddings.position_embeddings", (sizes.max_positions, h)),
            _Tensor("embeddings.token_type_embeddings", (sizes.type_vocab, h)),
        ] + _norm("embeddings.LayerNorm", h)
    for block in held:
        tensors += _block(sizes, block, degree, index)
    if last:
        decoder = _linear("cls.predictions.decoder", h, sizes.vocab, None, degree, index)
        tensors += (
            _linear("pooler.dense", h, h, None, degree, index)
            + _linear("cls.predictions.transform.dense", h, h, None, degree, index)
            + _norm("cls.predictions.transform.LayerNorm", h)
            + (decoder[1:] if first else decoder)
            + _linear("cls.seq_relationship", h, 2, None, degree, index)
        )
    return tensors


def transformer_stage_states(
    sizes: TransformerSizes,
    num_stages: int,
    layer_model: LinearModel | None = None,
    tensor_parallel: int = 1,
    index: int = 0,
    first_order: Sequence[str] = FIRST_ORDER,
    preconditions_bias: bool = True,
    stage_blocks: tuple[int, ...] = (),
) -> list[StageState]:
    """Each stage's `StageState` on tensor-parallel rank `index` of `tensor_parallel`: parameter
    sizes and shapes in the model's order; with `layer_model`, a curvature layer per Linear the
    method preconditions (all but the `first_order` globs) and the flags of the parameters it
    preconditions (weights, and biases when `preconditions_bias`), and the element counts of
    its blocks (FSDP2's units under ZeRO-3); the stages hold `stage_blocks` blocks each where
    given (`pipeline.stage_blocks`), else an even share. ValueError unless the stages split the
    blocks so and T divides hidden and ffn."""
    ranges = stage_block_ranges(sizes.blocks, num_stages, stage_blocks)
    if not 0 <= index < tensor_parallel:
        raise ValueError(f"index: expected 0..{tensor_parallel - 1}, got {index}")
    states = []
    for stage in range(num_stages):
        tensors = _stage_tensors(sizes, stage, ranges[stage], num_stages, tensor_parallel, index)
        curvature = [
            t
            for t in tensors
            if layer_model is not None
            and t.linear is not None
            and not any(fnmatch.fnmatchcase(t.module, pattern) for pattern in first_order)
        ]
        layers = (
            [layer_model(t.module, *t.linear) for t in curvature if len(t.shape) == 2 and t.linear is not None]
            if layer_model
            else []
        )
        chosen = {id(t) for t in curvature if len(t.shape) == 2 or preconditions_bias}
        numels = tuple(_numel(t.shape) for t in tensors)
        blocks = tuple(
            sum(_numel(t.shape) for t in _block(sizes, block, tensor_parallel, index)) for block in ranges[stage]
        )
        states.append(
            StageState(
                numels,
                tuple(layers),
                tuple(t.shape for t in tensors),
                tuple(id(t) in chosen for t in tensors),
                blocks,
            )
        )
    return states


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
