"""Local multi-process launcher (torchrun compatible) and process-group setup.

`run_group(fn, world)` starts `world` processes on this machine (forked from a server that has
imported torch once, `_context`), each with the launcher's environment plus what torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one thread each,
and runs `fn(rank, world, *args)` after `init_distributed`. The launcher itself serves the
group's rendezvous store (`hosted_store`) for the group's life, on a port the OS gives it unless
one is asked for: two groups on one host never race for a port. When a rank fails, the others get
`grace` seconds to fail on their own (they will, their peer is gone) and are then killed; with
a `deadline`, the whole group is killed when it passes. Child tracebacks come back in the error.
`world_of_one` makes this process a group by itself (a one-stage run in-process).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import multiprocessing.reduction as reduction
from multiprocessing.connection import wait
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipefisher.runtime.errors import first_line
from pipefisher.runtime.console import show_runtime_messages
from pipefisher.runtime.signals import STOP_SIGNALS, stop_request
from pipefisher.runtime.training.rendezvous import free_port, hosted_store
from pipefisher.runtime.training.stopping import signal_name, stop_signals_blocked


class Interrupted(RuntimeError):
    """A signal ended the group (its children were killed); exit with `exit_code`."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal_name(signum)}")
        self.exit_code = 128 + signum


class GroupFailure(RuntimeError):
    """One or more ranks failed; `failures` maps rank -> message (first line first)."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


def resolve_backend(backend: str) -> str:
    """'auto' is NCCL when CUDA is available, gloo otherwise."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def gpu_shortfall(backend: str, local_processes: int) -> str | None:
    """Why `local_processes` ranks on this machine cannot run under `backend`, if they cannot:
    NCCL gives each its own GPU (one GPU cannot host two NCCL ranks)."""
    available = torch.cuda.device_count()
    if resolve_backend(backend) != "nccl" or local_processes <= available:
        return None
    return (
        f"run.backend nccl: {local_processes} processes on this machine need {local_processes} GPUs, it has {available} "
        f"(one GPU cannot host two NCCL ranks); use --backend gloo, or fewer processes (pipeline.stages x pipeline.data_parallel x pipeline.tensor_parallel)"
    )


def current_device(backend: str) -> torch.device:
    """This process's device: its LOCAL_RANK's GPU under NCCL, the CPU under gloo."""
    if resolve_backend(backend) == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        problem = gpu_shortfall(backend, local_rank + 1)
        if problem is not None:
            raise ValueError(problem)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(backend: str, timeout: float, hosted: bool = False) -> torch.device:
    """Join the process group described by the torchrun environment; return this rank's device.
    `hosted`: the store at MASTER_ADDR:MASTER_PORT is the launcher's (`hosted_store`), every
    rank is its client (under torchrun, rank 0 serves it).

    Under torchrun's restarts (`--max-restarts`) every attempt of the workers shares the agent's
    key-value store, and keys of a dead attempt (e.g. a peer's old address) could be read by the
    next one: each attempt's keys get their own prefix.
    """
    backend = resolve_backend(backend)
    device = current_device(backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    wait = timedelta(seconds=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if hosted:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, wait)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=wait)
    elif attempt is None:
        dist.init_process_group(backend, init_method="env://", timeout=wait)
    else:
        found, rank, world = next(dist.rendezvous("env://", timeout=wait))
        attempt_store = dist.PrefixStore(f"pipefisher/attempt-{attempt}", found)
        dist.init_process_group(backend, store=attempt_store, rank=rank, world_size=world, timeout=wait)
    return device


@contextmanager
def world_of_one(backend: str, device: torch.device, port: int | None = None, timeout: float = 60.0) -> Iterator[None]:
    """This process as the whole process group (rank 0 of 1, `backend`, MASTER_PORT `port` or a
    free one) for as long as the context lasts; `device` becomes the current GPU when it is one.
    The torchrun variables it sets are restored after (a `pipefisher run` started later must not
    take itself for a rank of this group)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port or free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    saved = {name: os.environ.get(name) for name in group}
    os.environ.update(group)
    try:
        dist.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(seconds=timeout))
        try:
            yield
        finally:
            dist.destroy_process_group()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _stop_with_the_launcher(on_signal: str, joined: threading.Event) -> None:
    """Stop this rank when the launcher that started it is gone (killed outright: SIGKILL cannot
    be forwarded), through public APIs only: a thread waits on the launcher's sentinel
    (`multiprocessing.parent_process()`, readable once the launcher has died) and then sends this
    process SIGTERM, which stops the run after its step as any SIGTERM does (with a checkpoint);
    where the launcher ends the group itself (`on_signal="kill"`: the rank ignores SIGTERM), SIGKILL.
    Before `joined` is set (the rank still joining its group, its stop signals blocked, nothing to
    save) it leaves at once, exit 1: it would otherwise wait out the rendezvous timeout, and with it
    the forkserver that holds its place."""
    parent = mp.parent_process()
    if parent is None:
        return
    signum = signal.SIGKILL if on_signal == "kill" else signal.SIGTERM

    def watch() -> None:
        wait([parent.sentinel])
        if not joined.is_set():
            os._exit(1)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _child(
    call: bytes, rank: int, world: int, place: _Place, backend: str, timeout: float, results, on_signal: str
) -> None:
    """A rank's process, forked by the forkserver (`_context`). It starts with the stop signals
    blocked (see `run_group`) and lets them in once their handling is set and the process group is
    joined (a signal inside the store's connect makes it log a C++ stack): one that came meanwhile
    is handled then, not lost and not a traceback. It takes the launcher's environment, working
    directory, import path and streams (`place`) before it unpickles `call` = (fn, args)."""
    place.enter()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if on_signal == "kill":  # the launcher ends the group; the child must not die in the middle on its own
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    else:
        stop_request.install()
    torch.set_num_threads(1)
    show_runtime_messages()
    joined = threading.Event()
    _stop_with_the_launcher(on_signal, joined)
    code = 0
    try:
        fn, args = pickle.loads(call)
        init_distributed(backend, timeout, hosted=True)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        joined.set()
        # Plain pickle: tensors travel as bytes, not as shared memory this process takes with it.
        results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException as exc:
        code = 1
        results.put((rank, False, f"{first_line(exc)}\n{traceback.format_exc()}"))
    # Leave at once: a clean process-group shutdown can block on peers that are already gone.
    results.close()
    results.join_thread()
    os._exit(code)


#: what a rank's process imports before it is forked (`_context`): torch and the training code
PRELOADED = ("torch", "torch.distributed", "pipefisher.runtime.training.trainer")


def _adopt(wrapped) -> int:
    return wrapped.detach()


class _InheritedFd:
    """The launcher's file descriptor `fd`, duplicated into the rank's process when the process
    is started (multiprocessing's own fd passing): an int there."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _adopt, (reduction.DupFd(self.fd),)


@dataclass(frozen=True)
class _Place:
    """Where a rank runs: the launcher's environment (plus the group's variables), working
    directory, import path, stdout and stderr, which a forked process would otherwise take from
    the forkserver as they were when it started."""

    env: dict[str, str]
    cwd: str
    path: list[str]
    streams: tuple = field(default_factory=lambda: (_InheritedFd(1), _InheritedFd(2)))

    def enter(self) -> None:
        """Take them in the rank's process (its streams: the file descriptors it was handed)."""
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        for target, fd in zip((1, 2), self.streams):
            os.dup2(fd, target)
            os.close(fd)


def _context(preload: Sequence[str] = ()) -> mp.context.SpawnContext | mp.context.ForkServerContext:
    """Processes forked from one server that has imported `PRELOADED` and `preload` once (about
    2 s of CPU per process saved against spawning a fresh interpreter that imports torch; 3 s more
    for a Hugging Face model) where the platform has a forkserver; spawned otherwise. Neither
    inherits the launcher's threads. The server is this process's for its life: `preload` counts
    where this call starts it (`start_forkserver`)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOADED, *preload])
    return ctx


def start_forkserver(preload: Sequence[str] = ()) -> None:
    """Start this process's forkserver now, importing `PRELOADED` and `preload` (`_context`), with
    the stop signals blocked in it and every process it forks; nothing where one runs already or
    the platform has none."""
    _ensure_started(_context(preload))


def _ensure_started(ctx: mp.context.SpawnContext | mp.context.ForkServerContext) -> None:
    """Start `ctx`'s forkserver where it has one and none runs yet, with the stop signals blocked
    in it and every process it forks."""
    if ctx.get_start_method() == "forkserver":
        with stop_signals_blocked():
            forkserver.ensure_running()


def run_group(
    fn: Callable[..., Any],
    world: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout: float = 60.0,
    port: int | None = None,
    host: str = "127.0.0.1",
    deadline: float | None = None,
    grace: float | None = None,
    on_signal: str = "kill",
    store: dist.TCPStore | None = None,
    preload: Sequence[str] = (),
) -> list[Any]:
    """`[fn(rank, world, *args) for rank in range(world)]`, each in its own process.

    The ranks meet at `store` (a `hosted_store`), else at one this call serves on `port` (None or
    0: a port the OS picks; PortInUse when `port` is taken).

    `fn` must be importable (module level). `timeout` bounds any wait inside the group;
    `deadline` (seconds, optional) bounds the whole run. Raises GroupFailure naming every failed
    rank; no child outlives the call. SIGTERM or SIGINT to this process, at any moment: with
    `on_signal="forward"` every child gets it (and handles it: training stops after its step; it
    is sent again until the child exits, so a child still starting gets it too) and has
    `timeout` seconds to finish; with "kill" the children are killed and Interrupted is raised.
    Children start with the stop signals blocked (a Ctrl-C in a terminal reaches them too), so
    none dies with a traceback inside its interpreter's start. `preload`: modules every rank
    imports, which the forkserver imports once where this call starts it (`_context`).
    """
    ctx = _context(preload)
    results = ctx.Queue()
    store = store if store is not None else hosted_store(host, port or 0, timeout)
    env = {**os.environ, "MASTER_ADDR": host, "MASTER_PORT": str(store.port), "OMP_NUM_THREADS": "1"}
    place, call = _Place(env, os.getcwd(), list(sys.path)), pickle.dumps((fn, args))
    procs = [
        ctx.Process(target=_child, args=(call, rank, world, place, backend, timeout, results, on_signal), daemon=True)
        for rank in range(world)
    ]
    received: list[int] = []

    def forward(signum: int) -> None:
        for proc in procs:
            if proc.is_alive():
                if on_signal == "forward" and proc.pid is not None:
                    os.kill(proc.pid, signum)
                else:
                    proc.kill()

    def on_stop_signal(signum: int, frame) -> None:
        received.append(signum)
        forward(signum)

    previous = (
        {signum: signal.signal(signum, on_stop_signal) for signum in STOP_SIGNALS}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    end = time.monotonic() + deadline if deadline is not None else None
    grace = timeout if grace is None else grace
    outcome: dict[int, tuple[bool, Any]] = {}
    stopping = False
    try:
        _ensure_started(ctx)
        with stop_signals_blocked():  # one that comes meanwhile runs on_stop_signal after the block
            for proc in procs:
                proc.start()
        while len(outcome) < world:
            if received and on_signal == "kill":
                break
            if received and not stopping:  # the children have `timeout` to finish their step
                stopping = True
                stop_by = time.monotonic() + timeout + grace
                end = stop_by if end is None else min(end, stop_by)
            elif received:
                forward(received[0])  # again: harmless to a child that has it, needed by one still starting
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=0.2 if left is None else min(0.2, left))
                outcome[rank] = (ok, value)
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if proc.exitcode not in (None, 0) and rank not in outcome:
                        outcome[rank] = (False, f"process exited with code {proc.exitcode} (killed or crashed)")
            if any(not ok for ok, _ in outcome.values()):
                failed_at = time.monotonic()
                end = min(end, failed_at + grace) if end is not None else failed_at + grace
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join(5)
    if received and on_signal == "kill":
        raise Interrupted(received[0])
    failures = {rank: value for rank, (ok, value) in outcome.items() if not ok}
    for rank in range(world):
        if rank not in outcome:
            failures[rank] = "no result before the deadline; killed"
    if failures:
        lines = [f"rank {rank}: {message.splitlines()[0]}" for rank, message in sorted(failures.items())]
        details = "\n".join(f"--- rank {rank} ---\n{message}" for rank, message in sorted(failures.items()))
        raise GroupFailure("\n".join(["run failed", *lines, details]), failures)
    return [pickle.loads(outcome[rank][1]) for rank in range(world)]
