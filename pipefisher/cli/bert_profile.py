"""Write a BERT-like profile from a per-block reference CSV (e.g. the PipeFisher P100 measurements).

Usage: python -m pipefisher.cli.bert_profile CSV --stages D --micro-batch-size B -o PROFILE.yaml
[--model bert-base|bert-large] (default: the model the CSV's file name starts with) [--seq-len 128]
[--dtype fp32|bf16] [--tensor-parallel T [--tp-bandwidth GBPS]]. The model's blocks are cut into D stages of equal compute (see
`pipefisher.planning.transformer_profile`); times in ms; capture sizes for the sequence length and dtype;
with T > 1 the profile of one of T tensor-parallel ranks (its shards, its share of the block and the
modelled tensor-parallel all-reduces).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pipefisher.core.usage import USAGE_ERROR, UsageError
from pipefisher.core.profile import ProfileError
from pipefisher.methods.registry import REFERENCE_METHOD, task_rules
from pipefisher.planning.transformer_profile import (
    BERT_SIZES,
    DEFAULT_TP_BANDWIDTH_GBPS,
    read_block_times,
    transformer_profile,
)


_DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def _model(csv: Path, given: str | None) -> str:
    if given is not None:
        return given
    name = next((m for m in BERT_SIZES if csv.name.startswith(m)), None)
    if name is None:
        raise UsageError(
            f"{csv.name}: cannot tell the model from the file name; give --model {{{','.join(BERT_SIZES)}}}"
        )
    return name


def main(argv: Sequence[str] | None = None) -> int:
    """Exit code 0, or 2 with one line on stderr for bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m pipefisher.cli.bert_profile", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument(
        "csv", type=Path, help="per-block CSV with columns bs, time_f, time_b, time_kron, time_inv, time_prec"
    )
    parser.add_argument("--stages", "-D", type=int, required=True, help="pipeline stages D")
    parser.add_argument("--micro-batch-size", type=int, required=True, help="the CSV row (bs) to use")
    parser.add_argument("--model", choices=sorted(BERT_SIZES), help="model size (default: from the file name)")
    parser.add_argument("--seq-len", type=int, default=128, help="sequence length, for capture sizes (default 128)")
    parser.add_argument(
        "--dtype",
        choices=sorted(_DTYPE_BYTES),
        default="fp32",
        help="dtype the captured activations and gradients are held in (default fp32)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="T",
        help="profile one of T tensor-parallel ranks (Megatron's split of each block; default 1)",
    )
    parser.add_argument(
        "--tp-bandwidth",
        type=float,
        default=DEFAULT_TP_BANDWIDTH_GBPS,
        metavar="GBPS",
        help=f"all-reduce bus bandwidth in GB/s for the modelled tensor-parallel all-reduces (default {DEFAULT_TP_BANDWIDTH_GBPS:g})",
    )
    parser.add_argument("-o", "--output", type=Path, required=True, help="profile file to write (.yaml, or .json)")
    args = parser.parse_args(argv)
    try:
        model = _model(args.csv, args.model)
        blocks, hidden, ffn = BERT_SIZES[model]
        try:
            times = read_block_times(args.csv, args.micro_batch_size)
        except (OSError, KeyError, ValueError) as exc:
            if isinstance(exc, ProfileError):
                raise
            raise UsageError(f"cannot read block times from {args.csv}: {exc}") from None
        profile = transformer_profile(
            times,
            blocks,
            args.stages,
            hidden,
            ffn,
            args.micro_batch_size,
            device=args.csv.stem,
            seq_len=args.seq_len,
            capture_dtype_bytes=_DTYPE_BYTES[args.dtype],
            tensor_parallel=args.tensor_parallel,
            tp_bandwidth_gbps=args.tp_bandwidth,
            method=REFERENCE_METHOD,
            rules=task_rules(REFERENCE_METHOD),
        )
        # the table's sequence length and precision are its own, unknown here: only the model is recorded
        replace(profile, model=f"bert {model}").save(args.output)
    except (UsageError, ProfileError, OSError) as exc:
        print(f"bert_profile: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return USAGE_ERROR
    degree = f", tensor-parallel rank of {args.tensor_parallel}" if args.tensor_parallel > 1 else ""
    print(f"{args.output}: {blocks} blocks in {args.stages} stages, micro-batch size {args.micro_batch_size}{degree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
