import collections
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipefisher.data.corpus import (
    CacheUnwritable,
    corpus_fingerprint,
    embedded_corpus,
    prose_sentences,
    read_corpus,
    split_sentences,
    write_once,
)


@pytest.fixture(scope="module")
def corpus():
    return embedded_corpus()


def test_embedded_corpus_is_sizeable_real_english(corpus):
    sentences = [sentence for document in corpus for sentence in document]
    words = [word.lower().strip('.,;:()"') for sentence in sentences for word in sentence.split()]
    assert len(corpus) >= 150 and len(sentences) >= 5000 and len(words) >= 80_000
    assert all(len(document) >= 2 for document in corpus)
    counts = collections.Counter(words)
    assert counts.most_common(1)[0][0] == "the" and counts["the"] > 0.03 * len(words)
    for common in ("of", "and", "is", "in", "that", "function", "object", "returns"):
        assert counts[common] >= 100, common
    assert not any(">>>" in s or "::=" in s or "\n" in s or "  " in s or s != s.strip() for s in sentences)
    assert sum(sentence[0].isupper() or sentence[0] in "\"'(" for sentence in sentences) > 0.8 * len(sentences)


def test_embedded_corpus_is_deterministic_and_a_fresh_copy(corpus):
    again = embedded_corpus()
    assert again == corpus
    again[0].append("Mutating the copy must not leak.")
    again.pop()
    assert embedded_corpus() == corpus


def test_embedded_corpus_is_read_from_its_cache_file_once_written(corpus, tmp_path):
    """Each process of a run needs the corpus: the first writes it to the cache, the rest read it
    (a process's own copy is kept, so a fresh folder shows the reading)."""
    assert embedded_corpus(tmp_path) == corpus
    (written,) = tmp_path.glob("embedded-corpus-*.json")
    other = tmp_path / "other"
    other.mkdir()
    (other / written.name).write_text('[["Read from the file.", "Not rebuilt."]]', encoding="utf-8")
    assert embedded_corpus(other) == [["Read from the file.", "Not rebuilt."]]
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert embedded_corpus(blocked / "cache") == corpus, "a folder it cannot write costs only the time"


def test_split_sentences():
    text = (
        'He said "Stop." Then he  left.\nSee e.g. Python for more (and i.e. that.) Does it work? Yes, it does! 2. Items'
    )
    assert split_sentences(text) == [
        'He said "Stop."',
        "Then he left.",
        "See e.g. Python for more (and i.e. that.)",
        "Does it work?",
        "Yes, it does!",
    ]
    assert split_sentences("  ") == []


def test_prose_sentences_drop_code_tables_and_headings():
    text = """The "pass" statement
********************

"pass" is a null operation. When it is executed, nothing
happens. It is a built-
in placeholder.

   pass_stmt ::= "pass"

>>> def f(arg): pass
>>> f(1)

+------+------+
| a    | b    |
+------+------+

1. A list item with *emphasis* in
   it. And a second sentence.

          deeply_indented = code(that, ends.)
"""
    assert prose_sentences(text) == [
        '"pass" is a null operation.',
        "When it is executed, nothing happens.",
        "It is a built-in placeholder.",
        "A list item with emphasis in it.",
        "And a second sentence.",
    ]


def test_read_corpus_sentence_per_line(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(
        "The first document starts here.\nIt has a second sentence.\n\n"
        "A lone sentence is dropped.\n\n"
        "The third document has\tthree sentences.\nThis is one.\nThis is another one.\n"
    )
    expected = [
        ["The first document starts here.", "It has a second sentence."],
        ["The third document has three sentences.", "This is one.", "This is another one."],
    ]
    assert read_corpus(path) == expected
    assert read_corpus(path, "sentences") == expected


def test_read_corpus_plain_text(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(
        "It was a bright cold day in April, and the clocks were\nstriking thirteen. Winston "
        "Smith slipped quickly\nthrough the glass doors.\n\n"
        "The hallway smelt of boiled cabbage and old rag mats. At one end\nof it a coloured "
        "poster had been tacked to the wall.\n\nToo short.\n"
    )
    expected = [
        [
            "It was a bright cold day in April, and the clocks were striking thirteen.",
            "Winston Smith slipped quickly through the glass doors.",
        ],
        [
            "The hallway smelt of boiled cabbage and old rag mats.",
            "At one end of it a coloured poster had been tacked to the wall.",
        ],
    ]
    assert read_corpus(path) == expected
    assert read_corpus(path, "text") == expected
    assert read_corpus(path, "sentences")[0][0] == "It was a bright cold day in April, and the clocks were"
    path.write_text(path.read_text().replace("\n\n", "\n"))
    assert read_corpus(path) == [[sentence for document in expected for sentence in document] + ["Too short."]]
    with pytest.raises(ValueError, match="unknown corpus format"):
        read_corpus(path, "csv")


def test_write_once_keeps_the_first_file(tmp_path):
    path = tmp_path / "sub" / "cache.bin"
    assert write_once(path, lambda partial: partial.write_bytes(b"first")) == path
    write_once(path, lambda partial: partial.write_bytes(b"second"))
    assert path.read_bytes() == b"first"
    assert sorted(p.name for p in path.parent.iterdir()) == ["cache.bin"]


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_write_once_names_the_folder_it_cannot_write(tmp_path, code):
    def full(partial):
        raise OSError(code, os.strerror(code))

    with pytest.raises(CacheUnwritable) as caught:
        write_once(tmp_path / "cache.bin", full)
    message = str(caught.value)
    assert message.startswith(f"data cache {tmp_path}: cannot write there ({os.strerror(code)})")
    assert "PIPEFISHER_CACHE" in message and "data.cache_dir" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_cache_is_one_line_and_exit_2(tmp_path):
    """A cache folder under a regular file cannot be made, by root too (ENOTDIR)."""
    (tmp_path / "file").write_text("")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join("\n".join(f"Sentence {i} of document {d} is here." for i in range(3)) for d in range(6))
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PIPEFISHER_CACHE": str(tmp_path / "file" / "cache")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipefisher",
            "run",
            str(root / "schedules" / "tiny-cpu.yaml"),
            "--reference",
            "--steps",
            "1",
            "--data.corpus",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"pipefisher: error: data cache {tmp_path / 'file' / 'cache'}: cannot write there "
        "(Not a directory); point PIPEFISHER_CACHE or data.cache_dir (--data.cache_dir DIR) "
        "at a writable folder"
    )
    assert "Traceback" not in result.stderr


def test_fingerprint_sees_content_and_grouping():
    base = corpus_fingerprint([["a b", "c d"], ["e f", "g h"]])
    assert base == corpus_fingerprint([["a b", "c d"], ["e f", "g h"]])
    assert base != corpus_fingerprint([["a b"], ["c d", "e f", "g h"]])
    assert base != corpus_fingerprint([["a b", "c d"], ["e f", "g i"]])
