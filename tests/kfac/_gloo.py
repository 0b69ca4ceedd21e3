"""Run a function on N gloo ranks on 127.0.0.1 (spawned, one thread each) under one deadline."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, timeout: float,
           results: mp.Queue, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        try:
            results.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_gloo(fn: Callable[..., Any], world: int = 2, timeout: float = 60.0, args: tuple = ()) -> list[Any]:
    """``[fn(rank, world, *args) for each rank]`` with a process group initialised per rank.

    ``fn`` must be importable (module level). Raises RuntimeError with every child traceback if
    a rank fails, dies, or the group misses the deadline; all children are killed on exit.
    """
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, timeout, results, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcome) < world and (left := deadline - time.monotonic()) > 0:
            try:
                rank, ok, value = results.get(timeout=min(0.2, left))
                outcome[rank] = (ok, value)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in outcome:
                        outcome[r] = (False, f"died with exit code {p.exitcode}")
            if any(not ok for ok, _ in outcome.values()):
                deadline = min(deadline, time.monotonic() + 2.0)  # collect the others' errors
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcome.items()) if not ok]
    missing = [r for r in range(world) if r not in outcome]
    if failures or missing:
        head = "gloo group failed"
        if missing:
            head += f"; no result from ranks {missing} within the deadline"
        raise RuntimeError("\n".join([head, *failures]))
    return [outcome[r][1] for r in range(world)]
