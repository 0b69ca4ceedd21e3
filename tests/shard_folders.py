"""Prepared shard folders for tests, written with the format's own writer from real text and a
real tokenizer (what `pipefisher data prepare` writes, made here without it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pipefisher.data.pretraining import TokenizedCorpus
from pipefisher.data.shards.format import TOKENIZER_FILE, Manifest, SplitWriter, token_dtype


def sentence_corpus(documents: list[list[str]], tokenizer: Tokenizer) -> TokenizedCorpus:
    """Every sentence encoded without special tokens; empty sentences, then empty documents, dropped."""
    tokens, lengths, sizes = [], [], []
    for document in documents:
        encoded = [e.ids for e in tokenizer.encode_batch(document, add_special_tokens=False) if e.ids]
        if encoded:
            tokens += [i for ids in encoded for i in ids]
            lengths += [len(ids) for ids in encoded]
            sizes.append(len(encoded))
    return TokenizedCorpus(
        np.array(tokens, dtype=np.int32),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
    )


def write_shards(folder: Path, splits: dict[str, TokenizedCorpus], tokenizer: Tokenizer, chunk: int = 5) -> Manifest:
    """`splits` (name -> corpus) written to `folder` `chunk` documents at a time, with `tokenizer`."""
    vocab = tokenizer.get_vocab_size()
    dtype, infos = token_dtype(vocab), {}
    for name, corpus in splits.items():
        writer = SplitWriter(folder / name, dtype)
        sentence_lengths = np.diff(corpus.sentence_starts)
        for first in range(0, corpus.num_documents, chunk):
            last = min(first + chunk, corpus.num_documents)
            s0, s1 = corpus.document_starts[first], corpus.document_starts[last]
            writer.append(
                corpus.tokens[corpus.sentence_starts[s0] : corpus.sentence_starts[s1]],
                sentence_lengths[s0:s1],
                np.diff(corpus.document_starts[first : last + 1]),
            )
        infos[name] = writer.close()
    tokenizer.save(str(folder / TOKENIZER_FILE))
    manifest = Manifest(vocab, dtype.str, {"kind": "test"}, infos)
    manifest.write(folder)
    return manifest
