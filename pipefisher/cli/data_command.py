"""`pipefisher data prepare|verify|info`: corpora tokenized once into a shard folder
(`pipefisher.data.shards`), its checksums checked, its manifest shown."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from pipefisher.cli.args import UsageError, positive_int, say, whole
from pipefisher.core.table import format_table
from pipefisher.core.terminal import progress_bars


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def _cmd_prepare(args: argparse.Namespace) -> int:
    from pipefisher.data.shards.prepare import check_out_folder, prepare
    from pipefisher.data.shards.sources import EMBEDDED, all_documents, describe, distinct_documents, open_input
    from pipefisher.data.shards.tokenizing import TRAINED, resolve

    out = Path(args.output)
    check_out_folder(out, args.overwrite)
    if (args.repeat != 1 or args.shuffle_seed is not None) and args.inputs != [EMBEDDED]:
        raise UsageError("--repeat/--shuffle-seed: only with the single input 'embedded'")
    sources = [open_input(spec, args.field, args.split, args.repeat, args.shuffle_seed) for spec in args.inputs]
    resolved = resolve(args.tokenizer, args.vocab_size, distinct_documents(sources))
    if args.tokenizer in TRAINED:
        say(f"tokenizer {resolved.source}: {resolved.vocab_size} tokens")
    summary = prepare(
        all_documents(sources),
        resolved,
        out,
        workers=args.workers,
        holdout=args.holdout,
        holdout_seed=args.holdout_seed,
        source={"inputs": [describe(source) for source in sources]},
        progress=progress_bars() and not args.json,
    )
    if args.json:
        print(json.dumps({**asdict(summary), "tokens": summary.tokens, "tokens_per_second": summary.tokens_per_second}))
        return 0
    splits = ", ".join(
        f"{name} {info.documents:,} documents / {info.tokens:,} tokens" for name, info in summary.splits.items()
    )
    print(
        f"wrote {out}: {summary.documents:,} documents, {summary.tokens:,} tokens ({splits}), "
        f"{_bytes(summary.bytes_on_disk)} on disk; {summary.seconds:.1f} s, {summary.tokens_per_second:,.0f} tokens/s "
        f"on {summary.workers} workers ({summary.cpu_seconds:.1f} CPU s); peak RSS {summary.peak_rss_mib:.0f} MiB (largest worker "
        f"{summary.worker_peak_rss_mib:.0f} MiB)"
    )
    return 0


def _read_manifest(directory: str):
    from pipefisher.data.shards.format import Manifest, ShardError

    try:
        return Manifest.read(directory)
    except ShardError as exc:
        raise UsageError(f"DIR: {exc}") from None


def _cmd_verify(args: argparse.Namespace) -> int:
    from pipefisher.data.shards.format import verify

    manifest = _read_manifest(args.directory)
    damaged = verify(args.directory)
    files = sum(len(info.sha256) for info in manifest.splits.values())
    if damaged:
        print(f"{args.directory}: {len(damaged)} of {files} files damaged: {', '.join(damaged)}; prepare it again")
        return 1
    print(f"{args.directory}: all {files} files match their SHA-256")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    manifest = _read_manifest(args.directory)
    if args.json:
        print(json.dumps(asdict(manifest), indent=1))
        return 0
    tokenizer = manifest.tokenizer
    print(
        f"{args.directory}: {manifest.format}, {manifest.vocab_size:,} ids ({manifest.dtype}); tokenizer "
        f"{tokenizer.get('kind')} ({tokenizer.get('source')}), sha256 {tokenizer.get('sha256', '')[:12]}"
    )
    rows = [
        [name, f"{info.documents:,}", f"{info.sentences:,}", f"{info.tokens:,}"]
        for name, info in manifest.splits.items()
    ]
    print(format_table(["split", "documents", "sentences", "tokens"], rows))
    return 0


def add_data_parser(subparsers) -> None:
    parser = subparsers.add_parser("data", help="tokenize corpora once into token shards; verify or describe them")
    commands = parser.add_subparsers(dest="data_command", required=True, parser_class=type(parser))
    prepare = commands.add_parser("prepare", help="corpora -> a token shard folder (parallel over cores)")
    prepare.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text file (a sentence per line, blank lines between documents; or prose), JSON-lines file "
        "(.jsonl), datasets folder, or 'embedded' (the English text shipped with Python)",
    )
    prepare.add_argument("-o", "--output", required=True, metavar="OUT", help="folder to write")
    prepare.add_argument(
        "--tokenizer",
        default="bpe",
        help="bpe | wordpiece (trained on the inputs), a tokenizers JSON file, a Hugging Face tokenizer "
        "folder or name, or tiktoken:ENCODING (default bpe)",
    )
    prepare.add_argument("--vocab-size", type=positive_int, default=8000, help="of a trained tokenizer (default 8000)")
    prepare.add_argument("--field", default="text", help="text field of JSON lines and datasets rows (default text)")
    prepare.add_argument("--split", default="train", help="split of a datasets folder with several (default train)")
    prepare.add_argument(
        "--workers", type=positive_int, default=os.cpu_count() or 1, help="processes that tokenize (default: the cores)"
    )
    prepare.add_argument(
        "--holdout", type=_fraction, default=0.0, help="share of documents sent to the 'valid' split (default 0)"
    )
    prepare.add_argument("--holdout-seed", type=whole, default=0, help="seed of the held-out choice (default 0)")
    prepare.add_argument("--repeat", type=positive_int, default=1, help="passes over the 'embedded' corpus (default 1)")
    prepare.add_argument(
        "--shuffle-seed",
        type=whole,
        help="each pass over 'embedded' in an order drawn from this seed (default: corpus order)",
    )
    prepare.add_argument(
        "--overwrite", action="store_true", help="write into a non-empty OUT that is not a prepared folder"
    )
    prepare.add_argument("--json", action="store_true", help="print one JSON object instead of the summary line")
    prepare.set_defaults(handler=_cmd_prepare)
    verify = commands.add_parser("verify", help="check every file against the manifest's SHA-256 (exit 1: damaged)")
    verify.add_argument("directory", metavar="DIR", help="a prepared folder")
    verify.set_defaults(handler=_cmd_verify)
    info = commands.add_parser("info", help="the manifest: tokenizer, splits and their counts")
    info.add_argument("directory", metavar="DIR", help="a prepared folder")
    info.add_argument("--json", action="store_true", help="print the manifest as JSON")
    info.set_defaults(handler=_cmd_info)
