"""A run's reader of a prepared shard folder: the split memory-mapped, the folder's tokenizer
loaded, and the micro-batches of the objective the run's model trains (`causal`:
`ShardCausalData`, `bert`: `ShardPretrainingData`)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from pipefisher.data.shards.bert_reader import ShardPretrainingData
from pipefisher.data.shards.causal_reader import ShardCausalData
from pipefisher.data.shards.format import TOKENIZER_FILE, Manifest, ShardError, open_split

#: the objectives a shard folder is read for
OBJECTIVES = ("causal", "bert")


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer saved in a prepared folder; ShardError when it has none or it cannot be read."""
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        raise ShardError(
            f"{folder}: no {TOKENIZER_FILE}; a run needs the tokenizer the ids come from, prepare it again"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ShardError(f"{path}: not a tokenizer.json ({str(exc).splitlines()[0]}); prepare it again") from None


def open_shards(
    folder: str | Path,
    split: str,
    objective: str,
    seq_len: int,
    micro_batch_size: int,
    step_micro_batches: int,
    seed: int,
    mask_prob: float = 0.15,
) -> ShardCausalData | ShardPretrainingData:
    """The micro-batches of `objective` ("causal" or "bert") over `split` of the prepared `folder`;
    ShardError naming the folder for one that is not prepared, damaged, of a vocabulary larger
    than its tokenizer's, or that cannot make `objective`'s examples (e.g. BERT from a tokenizer
    without [CLS]/[SEP]/[MASK]/[PAD], or too little text for one sequence)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: {objective!r} is not one of {', '.join(OBJECTIVES)}")
    manifest = Manifest.read(folder)
    tokenizer = load_tokenizer(folder)
    if manifest.vocab_size > tokenizer.get_vocab_size():
        raise ShardError(
            f"{folder}: its ids span {manifest.vocab_size} tokens, more than the {tokenizer.get_vocab_size()} of its "
            f"{TOKENIZER_FILE}; prepare it again"
        )
    mapped = open_split(folder, split)
    try:
        if objective == "causal":
            return ShardCausalData(mapped, tokenizer, seq_len, micro_batch_size, step_micro_batches, seed)
        return ShardPretrainingData(mapped, tokenizer, seq_len, micro_batch_size, step_micro_batches, seed, mask_prob)
    except ValueError as exc:
        raise ShardError(f"{folder}: its {split!r} split cannot make {objective} examples ({exc})") from None
