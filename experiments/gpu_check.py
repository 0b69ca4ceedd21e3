"""Train a run file's model as a one-stage pipeline in this process, on CUDA or the CPU, and list
the host syncs that fire inside its steps.

`pipefisher run` cannot do this for a multi-stage run file on a one-GPU machine: its local
launcher starts one process per stage, each NCCL rank needs its own GPU (it refuses, exit 2);
`--reference` always trains on the CPU. Here the run is a world of one process (NCCL on cuda:0, or gloo on the
CPU) running the real executor, plan runner and curvature method's runtime with pipeline.stages = 1.

    python experiments/gpu_check.py schedules/tiny-cpu.yaml --device cuda --precision bf16 \
        --optimizer kfac --steps 20 --sync-debug 3 --json out.json

With `--sync-debug S`, steps after the first S run under `torch.cuda.set_sync_debug_mode("warn")`
and every warning is kept with the innermost pipefisher frame that led to it (CUDA only).
`--ops` times a few linear-algebra calls pipefisher uses (QR, eigh, cholesky_ex, K-FAC's
damped inverse, Shampoo's inverse root) under the same mode, outside of any run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipefisher.config import load_config  # noqa: E402
from pipefisher.methods.registry import methods  # noqa: E402
from pipefisher.runtime.training import build_run, train_pipelined, world_of_one  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402


class SyncLog:
    """Collects `set_sync_debug_mode("warn")` warnings with the pipefisher frame that caused them."""

    def __init__(self):
        self.sites: Counter = Counter()
        self.examples: dict[str, str] = {}
        self.active = False
        self._show = warnings.showwarning

    def __enter__(self):
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        return self

    def __exit__(self, *exc):
        warnings.showwarning = self._show
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}pipefisher{os.sep}" in f.filename]
        site = (
            f"{Path(frames[-1].filename).relative_to(ROOT)}:{frames[-1].lineno} {frames[-1].line}"
            if frames
            else f"{filename}:{lineno}"
        )
        self.sites[site] += 1
        self.examples.setdefault(site, "".join(traceback.format_list(frames[-4:])))


def train(args) -> dict:
    config = load_config(args.config).with_overrides(
        pipeline={"stages": 1, "schedule": "1f1b", "data_parallel": 1},
        optimizer={"name": args.optimizer},
        **{name: {"refresh_steps": args.refresh_steps} for name in methods()},
        run={"steps": args.steps, "precision": args.precision, "backend": "nccl" if args.device == "cuda" else "gloo"},
    )
    run = build_run(config)
    run.model  # noqa: B018 (built now: the tokenizer and tokens before the process group starts)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    syncs = SyncLog()
    steps: list[dict] = []
    last = [time.perf_counter()]

    def on_step(result) -> None:
        now = time.perf_counter()  # the step ended with a host read of its loss: the device is done
        steps.append(
            {
                "step": result.step,
                "loss": result.loss,
                "seconds": result.seconds,
                "wall": now - last[0],
                **{k: v for k, v in result.extra.items() if isinstance(v, (int, float, bool))},
            }
        )
        last[0] = now
        if args.sync_debug and device.type == "cuda" and result.step == args.sync_debug:
            torch.cuda.set_sync_debug_mode("warn")  # the steps after this one
        if not args.quiet:
            print(
                f"step {result.step}: loss {result.loss:.5f}, {1000 * result.seconds:.2f} ms",
                file=sys.stderr,
                flush=True,
            )

    with world_of_one(config.run.backend, device, args.port):
        with syncs:
            result = train_pipelined(config, 0, device, on_step=on_step, run=run)
        if device.type == "cuda":
            torch.cuda.synchronize()
    out = {
        "config": args.config,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "steps": steps,
        "losses": result.losses,
        "syncs_after_step": args.sync_debug or None,
        "syncs": dict(syncs.sites),
        "sync_stacks": syncs.examples,
        "max_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
    }
    return out


def ops(args) -> dict:
    """Host syncs and times of the linear algebra pipefisher calls, on CUDA."""
    from pipefisher.methods.kfac.factors import damped_inverse
    from pipefisher.methods.shampoo import roots

    device = torch.device("cuda", 0)
    n = args.ops
    a = torch.randn(n, n, device=device)
    spd = a @ a.T / n + torch.eye(n, device=device)
    tall = torch.randn(4 * n, 4, device=device)
    calls = {
        "linalg.qr (4n x 4, powersgd.py)": lambda: torch.linalg.qr(tall).Q,
        "linalg.eigh": lambda: torch.linalg.eigh(spd),
        "linalg.cholesky_ex": lambda: torch.linalg.cholesky_ex(spd),
        "kfac damped_inverse eigen": lambda: damped_inverse(spd, 0.1, "eigen"),
        "kfac damped_inverse cholesky": lambda: damped_inverse(spd, 0.1, "cholesky"),
    }
    calls["shampoo eigen_root (batch of 1)"] = lambda: roots.eigen_root(spd[None], 1e-6)
    calls["shampoo newton_root (batch of 1)"] = lambda: roots.newton_root(spd[None], 1e-6)
    calls["linalg.eigh batched (4, n, n)"] = lambda: torch.linalg.eigh(spd.expand(4, n, n).contiguous())
    out = {}
    for name, call in calls.items():
        try:
            call()
            torch.cuda.synchronize()
            with SyncLog() as log:
                torch.cuda.set_sync_debug_mode("warn")
                start = time.perf_counter()
                call()
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
                ms = 1000 * (time.perf_counter() - start)
            warned = sum(log.sites.values())
            out[name] = {"n": n, "ms": round(ms, 3), "sync_warnings": warned}
        except Exception as exc:  # noqa: BLE001 - report and go on
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="schedules/tiny-cpu.yaml")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--optimizer", default="lamb")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--refresh-steps", type=int, default=2, help="the curvature method's refresh interval (pinned)")
    parser.add_argument("--sync-debug", type=int, default=0, metavar="S", help="warn on host syncs after step S")
    parser.add_argument("--ops", type=int, default=0, metavar="N", help="check the linear algebra at size N instead")
    parser.add_argument("--port", type=int, default=0, help="MASTER_PORT of the world of one (0: a free one)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    out = ops(args) if args.ops else train(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if not args.ops:
        times = [s["wall"] for s in out["steps"][3:]] or [s["wall"] for s in out["steps"]]
        print(
            json.dumps(
                {
                    "losses": [round(x, 5) for x in out["losses"]],
                    "median_step_ms": round(1000 * sorted(times)[len(times) // 2], 2),
                    "syncs": out["syncs"],
                    "max_memory_mib": out["max_memory_mib"],
                }
            )
        )


if __name__ == "__main__":
    sys.exit(entry_point(main, "gpu_check"))
