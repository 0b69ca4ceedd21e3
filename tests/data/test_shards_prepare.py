"""`pipefisher data prepare|verify|info`: what is prepared is what the tokenizer makes of the
documents, the same bytes for any worker count, split by document, and checked by `verify`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from pipefisher.cli.main import main
from pipefisher.data.corpus import read_corpus, split_sentences
from pipefisher.data.pretraining import tokenize_corpus
from pipefisher.data.shards import prepare as prepare_module
from pipefisher.data.shards.format import MANIFEST, Manifest, open_split
from pipefisher.data.shards.prepare import held_out
from pipefisher.data.shards.sources import Embedded
from pipefisher.data.tokenizer import END_OF_TEXT, train_byte_level_bpe, train_wordpiece

WORDS = "the a pipeline stage sends its activations to the next one while curvature work fills every bubble".split()


def _documents(count: int, seed: int = 0) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    return [
        [
            " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9)))).capitalize() + "."
            for _ in range(rng.integers(2, 6))
        ]
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A corpus file (a sentence per line, blank lines between documents) with one literal
    end-of-text token in its text, and byte-level BPE and WordPiece tokenizers saved as JSON."""
    folder = tmp_path_factory.mktemp("corpus")
    documents = _documents(40)
    documents[3][1] = f"Text that names {END_OF_TEXT} inside it."
    path = folder / "corpus.txt"
    path.write_text("\n\n".join("\n".join(document) for document in documents) + "\n")
    train_byte_level_bpe(documents, 300).save(str(folder / "bpe.json"))
    train_wordpiece(documents, 120).save(str(folder / "wordpiece.json"))
    return path


def _prepare(source, out, tokenizer, *extra: str) -> None:
    assert main(["data", "prepare", str(source), "-o", str(out), "--tokenizer", str(tokenizer), *extra]) == 0


def _expected(corpus) -> list[np.ndarray]:
    """Each document's ids by encoding its sentences one by one (later ones with their joining
    space), the end-of-text token the text names removed."""
    tokenizer = Tokenizer.from_file(str(corpus.parent / "bpe.json"))
    end = tokenizer.token_to_id(END_OF_TEXT)
    return [
        np.array(
            [
                i
                for k, sentence in enumerate(document)
                for i in tokenizer.encode(sentence if k == 0 else " " + sentence, add_special_tokens=False).ids
                if i != end
            ]
        )
        for document in read_corpus(corpus, "sentences")
    ]


def test_prepared_tokens_are_the_tokenizers_encoding(corpus, tmp_path, capsys):
    _prepare(corpus, tmp_path / "out", corpus.parent / "bpe.json", "--workers", "1")
    assert "tokens/s" in capsys.readouterr().out
    split = open_split(tmp_path / "out")
    expected = _expected(corpus)
    assert split.num_documents == len(expected)
    for index, tokens in enumerate(expected):
        np.testing.assert_array_equal(split.document_tokens(index), tokens)
    manifest = Manifest.read(tmp_path / "out")
    assert manifest.tokenizer["kind"] == "file" and int(manifest.tokenizer["vocab_size"]) == manifest.vocab_size
    assert (tmp_path / "out" / "tokenizer.json").read_text() == Tokenizer.from_file(
        str(corpus.parent / "bpe.json")
    ).to_str()


def test_wordpiece_shards_match_the_pretraining_tokenization(corpus, tmp_path):
    _prepare(corpus, tmp_path / "out", corpus.parent / "wordpiece.json", "--workers", "1")
    split = open_split(tmp_path / "out")
    reference = tokenize_corpus(read_corpus(corpus), Tokenizer.from_file(str(corpus.parent / "wordpiece.json")))
    np.testing.assert_array_equal(split.tokens, reference.tokens)
    np.testing.assert_array_equal(split.sentence_starts, reference.sentence_starts)
    np.testing.assert_array_equal(split.document_starts, reference.document_starts)


def test_same_bytes_for_any_worker_count(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "CHUNK_DOCUMENTS", 3)  # many chunks, so their order matters
    for workers in ("1", "2"):
        _prepare(corpus, tmp_path / workers, corpus.parent / "bpe.json", "--workers", workers, "--holdout", "0.3")
    files = sorted(p.relative_to(tmp_path / "1") for p in (tmp_path / "1").rglob("*") if p.is_file())
    assert {str(f) for f in files} >= {"train/tokens.bin", "valid/tokens.bin", MANIFEST}
    for name in files:
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes(), name


def test_holdout_sends_whole_documents_to_valid(corpus, tmp_path):
    _prepare(
        corpus,
        tmp_path / "out",
        corpus.parent / "bpe.json",
        "--workers",
        "1",
        "--holdout",
        "0.3",
        "--holdout-seed",
        "7",
    )
    expected = _expected(corpus)
    documents = [block.split("\n") for block in corpus.read_text().strip().split("\n\n")]
    chosen = [held_out(document, 0.3, 7) for document in documents]
    assert 0 < sum(chosen) < len(expected)
    for name, wanted in (("train", False), ("valid", True)):
        split = open_split(tmp_path / "out", name)
        indices = [index for index, valid in enumerate(chosen) if valid == wanted]
        assert split.num_documents == len(indices)
        for position, index in enumerate(indices):
            np.testing.assert_array_equal(split.document_tokens(position), expected[index])


def test_every_copy_of_a_document_lands_in_one_split(tmp_path):
    """Held out by content: a corpus passed over twice (as --repeat does) trains on no held-out text."""
    documents = _documents(30, seed=3)
    path = tmp_path / "twice.txt"
    path.write_text("\n\n".join("\n".join(document) for document in documents + documents[::-1]) + "\n")
    train_byte_level_bpe(documents, 300).save(str(tmp_path / "bpe.json"))
    _prepare(path, tmp_path / "out", tmp_path / "bpe.json", "--workers", "1", "--holdout", "0.3")
    train, valid = (open_split(tmp_path / "out", name) for name in ("train", "valid"))
    seen = {
        split: {split_.document_tokens(d).tobytes() for d in range(split_.num_documents)}
        for split, split_ in (("train", train), ("valid", valid))
    }
    assert seen["valid"] and not seen["train"] & seen["valid"]
    assert train.num_documents + valid.num_documents == 2 * len(documents)


def test_json_lines_field_and_datasets_folder_agree(tmp_path, corpus):
    texts = [" ".join(document) for document in _documents(12, seed=1)]
    lines = tmp_path / "docs.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "body": text}) + "\n" for i, text in enumerate(texts)))
    _prepare(lines, tmp_path / "jsonl", corpus.parent / "bpe.json", "--field", "body", "--workers", "1")
    split = open_split(tmp_path / "jsonl")
    assert split.num_documents == len(texts)
    assert split.num_sentences == sum(len(split_sentences(text)) for text in texts)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "dataset"))
    _prepare(tmp_path / "dataset", tmp_path / "hf", corpus.parent / "bpe.json", "--field", "body", "--workers", "1")
    for name in ("tokens.bin", "sentence_starts.bin", "document_starts.bin"):
        assert (tmp_path / "hf" / "train" / name).read_bytes() == (tmp_path / "jsonl" / "train" / name).read_bytes()


def test_verify_and_info_through_the_cli(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    _prepare(corpus, out, corpus.parent / "bpe.json", "--workers", "1", "--holdout", "0.3")
    capsys.readouterr()
    assert main(["data", "verify", str(out)]) == 0
    assert main(["data", "info", str(out)]) == 0
    assert "valid" in capsys.readouterr().out
    tokens = out / "valid" / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[0] ^= 1
    tokens.write_bytes(bytes(data))
    assert main(["data", "verify", str(out)]) == 1
    assert str(tokens) in capsys.readouterr().out


def test_a_failure_midway_leaves_no_manifest(tmp_path, corpus, capsys):
    lines = tmp_path / "docs.jsonl"
    lines.write_text(json.dumps({"text": "One sentence here. Another one there."}) + "\n{broken\n")
    assert (
        main(
            ["data", "prepare", str(lines), "-o", str(tmp_path / "out"), "--tokenizer", str(corpus.parent / "bpe.json")]
        )
        == 2
    )
    assert "docs.jsonl:2" in capsys.readouterr().err
    assert not (tmp_path / "out" / MANIFEST).exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.txt"], "INPUT: missing.txt does not exist"),
        (["{corpus}", "--holdout", "1.5"], "--holdout"),
        (["{corpus}", "--tokenizer", "tiktoken:gpt2"], "--tokenizer tiktoken:gpt2"),
        (["{corpus}", "--tokenizer", "{corpus}"], "--tokenizer"),
        (["{corpus}", "--repeat", "3"], "--repeat"),
        (["{corpus}", "--field", "body", "-o", "{corpus_dir}"], "OUT"),
        (["{jsonl}", "--field", "body"], "--field"),
        (["{corpus}", "--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size"),
        (["{binary}"], "is not UTF-8 text"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, corpus, tmp_path, capsys):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"text": "One sentence here. Another one there."}) + "\n")
    binary = tmp_path / "image.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    names = {"corpus": corpus, "corpus_dir": corpus.parent, "jsonl": jsonl, "binary": binary}
    filled = [arg.format(**names) for arg in args]
    if "-o" not in filled:
        filled += ["-o", str(tmp_path / "out")]
    assert main(["data", "prepare", *filled]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_verify_of_a_folder_that_is_not_prepared_is_a_usage_error(tmp_path, capsys):
    assert main(["data", "verify", str(tmp_path)]) == 2
    assert "DIR" in capsys.readouterr().err


def test_embedded_passes_are_seeded_permutations():
    passes = list(Embedded(repeat=2, shuffle_seed=3).documents())
    first, second = passes[: len(passes) // 2], passes[len(passes) // 2 :]
    assert sorted(map(tuple, first)) == sorted(map(tuple, second)) and first != second
    assert passes == list(Embedded(repeat=2, shuffle_seed=3).documents())
