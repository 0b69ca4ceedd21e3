import time

import pytest
from tokenizers import Tokenizer

from pipefisher.data.corpus import embedded_corpus
from pipefisher.data.tokenizer import SPECIAL_TOKENS, SpecialIds, load_vocab, train_wordpiece, wordpiece_cache_path

VOCAB_SIZE = 1000


@pytest.fixture(scope="module")
def documents():
    return embedded_corpus()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def tokenizer(documents, cache_dir):
    return train_wordpiece(documents, VOCAB_SIZE, cache_dir)


def test_special_ids_are_the_first_five(tokenizer):
    assert SpecialIds.from_tokenizer(tokenizer) == SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4)
    assert [tokenizer.id_to_token(i) for i in range(5)] == list(SPECIAL_TOKENS)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE


def test_round_trip_uses_wordpiece_continuations(tokenizer):
    sentence = "The Interpreter raises an exception when it detects unfathomable Café errors"
    encoding = tokenizer.encode(sentence, add_special_tokens=False)
    assert any(token.startswith("##") for token in encoding.tokens)
    assert "[UNK]" not in encoding.tokens
    assert (
        tokenizer.decode(encoding.ids) == "the interpreter raises an exception when it detects unfathomable cafe errors"
    )


def test_pair_encoding_has_bert_layout(tokenizer):
    encoding = tokenizer.encode("A first sentence.", "And the second one.")
    sep = encoding.tokens.index("[SEP]")
    assert encoding.tokens[0] == "[CLS]" and encoding.tokens[-1] == "[SEP]" and encoding.tokens.count("[SEP]") == 2
    assert encoding.type_ids == [0] * (sep + 1) + [1] * (len(encoding.tokens) - sep - 1)


def test_second_call_reads_the_cache(documents, cache_dir, tokenizer):
    path = wordpiece_cache_path(documents, VOCAB_SIZE, cache_dir)
    assert path.is_file() and sorted(p.name for p in cache_dir.iterdir()) == [path.name]
    assert Tokenizer.from_file(str(path)).to_str() == tokenizer.to_str()
    marked = Tokenizer.from_file(str(path))
    marked.add_tokens(["pipefishermarker"])
    marked.save(str(path))
    started = time.perf_counter()
    assert train_wordpiece(documents, VOCAB_SIZE, cache_dir).token_to_id("pipefishermarker") == VOCAB_SIZE
    cached = time.perf_counter() - started
    started = time.perf_counter()
    train_wordpiece(documents, VOCAB_SIZE)
    assert cached < (time.perf_counter() - started) / 5, "a cached call must not train"
    assert wordpiece_cache_path(documents, VOCAB_SIZE + 1, cache_dir) != path
    assert wordpiece_cache_path(documents[1:], VOCAB_SIZE, cache_dir) != path


def test_too_small_vocab_is_rejected(documents):
    with pytest.raises(ValueError, match="special tokens"):
        train_wordpiece(documents, 5)


def test_load_vocab(tmp_path):
    words = ["the", "quick", "brown", "fox", "jump", "over", "lazy", "dog", ".", "##s", "##ed"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join([*SPECIAL_TOKENS, *words]) + "\n")
    tokenizer = load_vocab(path)
    assert SpecialIds.from_tokenizer(tokenizer) == SpecialIds(0, 1, 2, 3, 4)
    encoding = tokenizer.encode("The quick brown fox jumped over the lazy dogs. Wombat!", add_special_tokens=False)
    assert encoding.tokens == [
        "the",
        "quick",
        "brown",
        "fox",
        "jump",
        "##ed",
        "over",
        "the",
        "lazy",
        "dog",
        "##s",
        ".",
        "[UNK]",
        "[UNK]",
    ]
    assert encoding.ids[:3] == [5, 6, 7]
    assert tokenizer.encode("The fox.").tokens == ["[CLS]", "the", "fox", ".", "[SEP]"]
    path.write_text("\n".join(words) + "\n")
    with pytest.raises(ValueError, match=r"lacks special token\(s\) \[PAD\], \[UNK\]"):
        load_vocab(path)
