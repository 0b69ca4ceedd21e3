"""Text corpora as documents of sentences: the English text that ships with Python, or a file.

A corpus is `list[list[str]]`: documents in a fixed order, each a list of non-empty sentences
with whitespace collapsed. Documents with fewer than two sentences are dropped (next-sentence
prediction needs a sentence that follows another).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import re
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeGuard

from pipefisher.core.settings import ConfigError

# Pure-Python standard-library modules (present in Python 3.10 to 3.14 and not split into
# separate distro packages such as python3-tk) whose docstrings join the embedded corpus; they
# are read as source, never imported.
DOCSTRING_MODULES: tuple[str, ...] = (
    "_pydecimal",
    "_pyio",
    "abc",
    "argparse",
    "ast",
    "asyncio.base_events",
    "asyncio.events",
    "asyncio.locks",
    "asyncio.queues",
    "asyncio.streams",
    "asyncio.tasks",
    "base64",
    "bisect",
    "bz2",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "collections",
    "colorsys",
    "concurrent.futures._base",
    "configparser",
    "contextlib",
    "copy",
    "copyreg",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "dis",
    "doctest",
    "email.message",
    "email.parser",
    "email.utils",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "getpass",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "heapq",
    "hmac",
    "html.parser",
    "http.client",
    "http.cookiejar",
    "http.server",
    "imaplib",
    "importlib.metadata",
    "inspect",
    "ipaddress",
    "json.decoder",
    "json.encoder",
    "keyword",
    "linecache",
    "locale",
    "logging",
    "logging.handlers",
    "lzma",
    "mailbox",
    "mimetypes",
    "multiprocessing.managers",
    "multiprocessing.pool",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "profile",
    "pstats",
    "py_compile",
    "pyclbr",
    "pydoc",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "rlcompleter",
    "runpy",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3.dump",
    "ssl",
    "stat",
    "statistics",
    "string",
    "subprocess",
    "symtable",
    "sysconfig",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "types",
    "typing",
    "unittest.case",
    "unittest.mock",
    "urllib.parse",
    "urllib.request",
    "urllib.robotparser",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "webbrowser",
    "wsgiref.handlers",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "xml.sax.handler",
    "xmlrpc.client",
    "zipapp",
    "zipfile",
    "zipimport",
    "zoneinfo",
)

_SENTENCE_END = re.compile(r"(?<!\b[eE]\.g\.)(?<!\b[iI]\.e\.)(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")
_TERMINAL = re.compile(r"[.!?][\"')\]]*$")
_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.\s|\$ |[+|]|[-=*~^#]{3,}\s*$)|::=|\s--?>\s|\)\s*->")
_MARKER = r"(?:\*|-|\d+\.|\[\d+\]|\(\d+\))"
_LIST_MARKER = re.compile(rf"^\s*{_MARKER}\s+")
_BLANK_LINE = r"\n\s*\n"
_DOCUMENT_BREAK = re.compile(_BLANK_LINE)
_PARAGRAPH_BREAK = re.compile(rf"{_BLANK_LINE}|\n(?=\s*{_MARKER}\s)")
_HYPHEN_BREAK = re.compile(r"(\w-)\n\s*(?=[a-z])")
_EMPHASIS = re.compile(r'(?<![\w*])\*{1,2}(?=\w)([^*"\n]+?)(?<=\S)\*{1,2}(?!\*)')
_WHITESPACE = re.compile(r"\s+")
_HEAVY_INDENT = 5


def split_sentences(text: str) -> list[str]:
    """Sentences of `text` (whitespace collapsed), split after . ! ? before an upper-case start;
    one-word fragments (list numbers, "Note:") are dropped."""
    text = _WHITESPACE.sub(" ", text).strip()
    return [sentence for sentence in _SENTENCE_END.split(text) if " " in sentence] if text else []


def prose_sentences(text: str) -> list[str]:
    """Sentences of the prose paragraphs of reStructuredText-like `text`; code, grammar, tables,
    headings and heavily indented blocks are dropped, list markers and *emphasis* stripped.
    A paragraph ends at a blank line and before a list item."""
    sentences = []
    for paragraph in _PARAGRAPH_BREAK.split(text):
        lines = [line for line in paragraph.splitlines() if line.strip()]
        if not lines or any(_CODE_LINE.search(line) for line in lines):
            continue
        if min(len(line) - len(line.lstrip()) for line in lines) >= _HEAVY_INDENT:
            continue
        prose = " ".join(line.strip() for line in _HYPHEN_BREAK.sub(r"\1", "\n".join(lines)).splitlines())
        prose = _EMPHASIS.sub(r"\1", _LIST_MARKER.sub("", prose))
        if _TERMINAL.search(prose) and len(prose.split()) >= 4:
            sentences.extend(split_sentences(prose))
    return sentences


def _stdlib_source(name: str, stdlib: Path) -> Path:
    """Path of the source file of pure-Python standard-library module `name` (not imported)."""
    base = stdlib.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise FileNotFoundError(f"no source for standard-library module {name!r} under {base.parent}")


_Documented = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def _public(node: ast.AST) -> TypeGuard[ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef]:
    return isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")


def _module_docstrings(name: str, stdlib: Path) -> str:
    """Docstrings of module `name`, then of its public top-level classes (each followed by its
    public methods) and functions, in source order, separated by blank lines. Read from the
    source with `ast`, so neither imports nor monkey-patching by other libraries change it."""
    module = ast.parse(_stdlib_source(name, stdlib).read_text(encoding="utf-8"))
    nodes: list[_Documented] = [module]
    for node in filter(_public, module.body):
        nodes.append(node)
        if isinstance(node, ast.ClassDef):
            nodes.extend(filter(_public, node.body))
    docs = (ast.get_docstring(node) for node in nodes)
    return "\n\n".join(doc for doc in docs if doc)


def embedded_corpus(cache_dir: str | Path | None = None) -> list[list[str]]:
    """Real English that ships with Python: one document per `pydoc_data.topics` entry (sorted
    by key), then one per module of `DOCSTRING_MODULES` (its docstrings). Fixed for a Python
    version; identical documents are kept once. Built once per process (1-3 s of CPU); with
    `cache_dir`, read from a file there once a process has written it (milliseconds: each process
    of a run needs it). Returned as a fresh copy."""
    documents = _embedded_documents() if cache_dir is None else _cached_documents(Path(cache_dir))
    return [list(document) for document in documents]


@functools.cache
def _cached_documents(cache_dir: Path) -> tuple[tuple[str, ...], ...]:
    """`_embedded_documents()` through a JSON file in `cache_dir`, keyed by the Python build and
    this module's source (either changes the text). A folder that cannot be written is left to the
    tokenizer's cache, which reports it; an unreadable file is rebuilt."""
    key = hashlib.sha256(f"{sys.version}\n{sysconfig.get_paths()['stdlib']}\n".encode() + Path(__file__).read_bytes())
    path = cache_dir / f"embedded-corpus-{key.hexdigest()[:16]}.json"
    try:
        return tuple(tuple(document) for document in json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        pass
    documents = _embedded_documents()

    def write(partial: Path) -> None:
        partial.write_text(json.dumps(documents), encoding="utf-8")

    try:
        write_once(path, write)
    except CacheUnwritable:
        pass
    return documents


@functools.cache
def _embedded_documents() -> tuple[tuple[str, ...], ...]:
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [topics[key] for key in sorted(topics)] + [_module_docstrings(name, stdlib) for name in DOCSTRING_MODULES]
    documents: dict[tuple[str, ...], None] = {}
    for text in texts:
        sentences = tuple(prose_sentences(text))
        if len(sentences) >= 2:
            documents.setdefault(sentences)
    return tuple(documents)


def _is_sentence_per_line(text: str) -> bool:
    """Whether `text` looks like the pretraining format: blank lines between documents and most
    lines that are followed by another line ending a sentence (wrapped prose mostly does not)."""
    blocks = [block.splitlines() for block in _DOCUMENT_BREAK.split(text.strip()) if block.strip()]
    if len(blocks) < 2:
        return False
    followed = [line.strip() for block in blocks for line in block[:-1] if line.strip()]
    return not followed or sum(bool(_TERMINAL.search(line)) for line in followed) >= len(followed) / 2


def read_corpus(path: str | Path, fmt: Literal["auto", "sentences", "text"] = "auto") -> list[list[str]]:
    """Documents of the UTF-8 file at `path` (those with fewer than two sentences dropped).
    "sentences": one sentence per line, blank lines between documents (BERT's pretraining
    format). "text": plain prose, split into sentences; each paragraph (block between blank
    lines) is a document, a file without blank lines is one document. "auto": "sentences" if
    the file has blank lines and at least half of the lines followed by another line end a
    sentence, else "text"."""
    if fmt not in ("auto", "sentences", "text"):
        raise ValueError(f"unknown corpus format {fmt!r}; expected 'auto', 'sentences' or 'text'")
    text = Path(path).read_text(encoding="utf-8")
    per_line = fmt == "sentences" or (fmt == "auto" and _is_sentence_per_line(text))
    documents = []
    for block in _DOCUMENT_BREAK.split(text):
        if per_line:
            sentences = [_WHITESPACE.sub(" ", line).strip() for line in block.splitlines() if line.strip()]
        else:
            sentences = split_sentences(block)
        if len(sentences) >= 2:
            documents.append(sentences)
    return documents


class CacheUnwritable(ConfigError):
    """The data cache folder cannot be written (read-only, not a folder, no permission, full);
    the message is one line naming the folder, the reason and the two settings that move it."""

    def __init__(self, folder: Path, error: OSError):
        reason = error.strerror or type(error).__name__
        super().__init__(
            f"data cache {folder}: cannot write there ({reason}); point PIPEFISHER_CACHE or data.cache_dir "
            f"(--data.cache_dir DIR) at a writable folder"
        )


def write_once(path: Path, write: Callable[[Path], None]) -> Path:
    """Create cache file `path` with `write(temporary path)` unless it exists. Publishing is a
    hard link, atomic and first-writer-wins: concurrent processes all end up reading the same
    complete file. Returns `path`. Raises CacheUnwritable when the folder cannot be created or
    written (any OSError of the file system: EROFS, EACCES, ENOTDIR, ENOSPC, ...)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.open("wb").close()  # an OSError here, not inside a writer that reports its own way (tokenizers)
        write(partial)
        os.link(partial, path)
    except FileExistsError:
        pass
    except OSError as exc:
        raise CacheUnwritable(path.parent, exc) from exc
    finally:
        try:
            partial.unlink(missing_ok=True)
        except OSError:
            pass  # the folder is not there or not a folder: nothing was written
    return path


def corpus_fingerprint(documents: list[list[str]]) -> str:
    """SHA-256 hex digest of the documents' sentences and their grouping (cache key)."""
    digest = hashlib.sha256()
    for document in documents:
        for sentence in document:
            digest.update(sentence.encode("utf-8"))
            digest.update(b"\x1f")
        digest.update(b"\x1e")
    return digest.hexdigest()
