"""`pipefisher checkpoint inspect DIR`: what a checkpoint holds (step, model, method, layout, the
refresh cycle's position, bytes per kind, the ZeRO degree it was written with) and whether every
file verifies against its manifest."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipefisher.cli.args import UsageError, positive_int


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def zero_degree(manifest: dict) -> int | None:
    """The `optimizer.zero` the step was written with (its manifest's layout), or None where the
    manifest does not record it (written before it did, or before layout-free checkpoints)."""
    value = manifest.get("layout", {}).get("optimizer.zero")
    return None if value is None else int(value)


def _zero_line(manifest: dict) -> str:
    """The ZeRO degree the step was written with, and what that means for resuming it."""
    zero = zero_degree(manifest)
    if zero is None:
        return "zero:     not recorded (written before checkpoints recorded optimizer.zero): as 0"
    if zero == 0:
        return "zero:     ZeRO-0 (optimizer.zero 0: nothing sharded)"
    replicas = manifest["layout"].get("pipeline.data_parallel", 1)
    sharded = {
        1: "the optimizer state",
        2: "gradients and optimizer state (FSDP2)",
        3: "parameters, gradients and optimizer state (FSDP2)",
    }
    return (
        f"zero:     ZeRO-{zero} (optimizer.zero {zero}: {sharded.get(zero, 'its state')} sharded over each stage's "
        f"{replicas} replica{'' if replicas == 1 else 's'} while training); saved whole: any optimizer.zero resumes it"
    )


def describe(folder: Path, manifest: dict) -> tuple[list[str], str | None]:
    """The lines `inspect` prints for the step in `folder` (its manifest read), and why it does
    not verify (None: it does)."""
    from pipefisher.runtime.training.checkpoint import FORMAT, verify
    from pipefisher.runtime.training.resumption import describe_layout, describe_model

    problem = verify(folder, manifest)
    files = manifest.get("files", {})
    lines = [f"checkpoint {folder}: step {manifest.get('step')}"]
    if manifest.get("format") != FORMAT:
        lines.append(
            f"format:   {manifest.get('format', 1)}, written before layout-free checkpoints (format {FORMAT}): "
            "this pipefisher cannot resume it"
        )
    else:
        config = manifest["config"]
        lines.append(
            f"model:    {describe_model(config)}; optimizer {config.get('optimizer.name')}, precision {config.get('run.precision')}"
        )
        lines.append(
            f"layout:   {describe_layout({**manifest['layout'], **manifest.get('plan', {})})}; {len(files)} processes"
        )
        cycle = manifest.get("cycle")
        if cycle is not None:
            where = "at a boundary" if cycle["position"] == 0 else f"inside, after step {cycle['position']}"
            lines.append(f"cycle:    refresh every {cycle['refresh_steps']} steps, {where}")
        kinds: dict[str, int] = {}
        for entry in files.values():
            for kind, count in entry.get("bytes", {}).items():
                kinds[kind] = kinds.get(kind, 0) + count
        total = sum(entry["size"] for entry in files.values())
        lines.append(
            "bytes:    "
            + ", ".join(f"{kind} {_bytes(count)}" for kind, count in sorted(kinds.items()) if count)
            + f" (tensors); {_bytes(total)} on disk"
        )
        lines.append(_zero_line(manifest))
    lines.append(f"verifies: {'yes: every file has its size and SHA-256' if problem is None else 'NO: ' + problem}")
    return lines, problem


def _cmd_inspect(args: argparse.Namespace) -> int:
    from pipefisher.runtime.training.checkpoint import MANIFEST, read_manifest, step_folder, steps

    directory = Path(args.directory)
    if not directory.is_dir():
        raise UsageError(f"DIR: {directory} is not a folder")
    if args.step is not None:
        folder = step_folder(directory, args.step)
    else:
        complete = [folder for _, folder in steps(directory) if (folder / MANIFEST).exists()]
        if not complete:
            raise UsageError(f"DIR: {directory} holds no complete checkpoint (no step-*/{MANIFEST})")
        folder = complete[0]
    try:
        manifest = read_manifest(folder)
    except FileNotFoundError:
        raise UsageError(f"--step: {folder} has no {MANIFEST} (missing or stopped while saving)") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{folder / MANIFEST} is unreadable: {exc}") from None
    lines, problem = describe(folder, manifest)
    if args.json:
        print(
            json.dumps(
                {
                    "folder": str(folder),
                    "manifest": {k: v for k, v in manifest.items() if k != "files"},
                    "zero": zero_degree(manifest),
                    "files": {
                        name: {k: v for k, v in entry.items() if k != "keys"}
                        for name, entry in manifest["files"].items()
                    },
                    "problem": problem,
                },
                indent=1,
            )
        )
    else:
        print("\n".join(lines))
    return 0 if problem is None else 1


def add_checkpoint_parser(subparsers) -> None:
    parser = subparsers.add_parser("checkpoint", help="inspect a run's checkpoints")
    commands = parser.add_subparsers(dest="checkpoint_command", required=True, parser_class=type(parser))
    inspect = commands.add_parser(
        "inspect", help="what a checkpoint holds and whether it verifies (exit 1: it does not)"
    )
    inspect.add_argument("directory", metavar="DIR", help="the run's checkpoint.dir")
    inspect.add_argument("--step", type=positive_int, help="the step to inspect (default: the newest complete one)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler=_cmd_inspect)
