"""The run file's `data` section: where micro-batches come from, each key declared once. Pure Python:
no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipefisher.core.settings import setting


def max_predictions(seq_len: int, mask_prob: float) -> int:
    """Most positions a BERT pretraining example of `seq_len` labels at `mask_prob` (its
    [CLS] and two [SEP] never): the width of `mlm_positions`, NVIDIA's max_predictions_per_seq."""
    candidates = seq_len - 3
    return min(candidates, max(1, round(mask_prob * candidates)))


@dataclass(frozen=True)
class DataConfig:
    """Micro-batches, a pure function of (seed, step, micro-batch id)."""

    kind: Literal["synthetic", "bert", "causal", "shards"] = setting(
        "synthetic",
        "synthetic: regression data; bert: sentence pairs with masking; causal: next-token prediction; "
        "shards: a prepared folder (data.shards), read for the model's objective (bert or causal)",
    )
    shards: str = setting(
        "", "shards: the folder `pipefisher data prepare` wrote (manifest.json, tokenizer.json, train/, valid/)"
    )
    seed: int = setting(0, "seed of the data")
    micro_batch_size: int = setting(4, "sequences per micro-batch", low=0, low_open=True)
    corpus: str = setting(
        "embedded",
        'text: "embedded" (English text shipped with Python) or a file (one sentence per line, blank line between documents)',
    )
    vocab: str = setting("", 'bert: a WordPiece vocab.txt ("" = train one of vocab_size on the corpus)')
    tokenizer: str = setting("", 'causal: a byte-level BPE tokenizer.json ("" = train one of vocab_size on the corpus)')
    vocab_size: int = setting(4000, "size of a tokenizer trained on the corpus", low=0, low_open=True)
    mask_prob: float = setting(0.15, "bert: share of tokens masked", low=0, high=1, low_open=True, high_open=True)
    cache_dir: str = setting("", 'where tokenizers and tokens are cached ("" = the default cache folder)')
    holdout: float = setting(
        0.0,
        "text: share of the corpus's documents never trained on, for held-out evaluation (0 = none)",
        low=0,
        high=1,
        high_open=True,
    )


def has_held_out_split(data: DataConfig) -> bool:
    """Whether `data` has a split that training never sees, for held-out evaluation
    (`run.eval_every`): text data (bert, causal) with `holdout` > 0, or shards (their `valid`
    split, whose presence is checked when its micro-batches are read). A data kind with its own
    split says so here, and serves its micro-batches through
    `pipefisher.runtime.training.assembly.held_out_batches`."""
    return (data.kind in ("bert", "causal") and data.holdout > 0) or data.kind == "shards"
