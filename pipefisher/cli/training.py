"""`pipefisher run` and `pipefisher profile`: train or measure from a run file, on local processes,
under torchrun, or in one process; what they print (the runtime they drive logs, it does not print)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import torch

from pipefisher.config import RunConfig
from pipefisher.core.profile import load_profile
from pipefisher.core.stage_split import counts_text
from pipefisher.methods.flop_report import flop_report
from pipefisher.methods.registry import method, method_of
from pipefisher.models.registry import preload_of
from pipefisher.runtime.errors import first_line
from pipefisher.runtime.training.launch import (
    GroupFailure,
    Interrupted,
    current_device,
    gpu_shortfall,
    init_distributed,
    resolve_backend,
    run_group,
)
from pipefisher.runtime.training.rendezvous import PortInUse, hosted_store, port_in_use
from pipefisher.runtime.signals import stop_request
from pipefisher.runtime.training.stopping import Stopped
from pipefisher.schedules import chunks_per_rank

if TYPE_CHECKING:  # the training stack is imported where a rank trains, not by the launcher
    from pipefisher.cli.step_report import StepReporter
    from pipefisher.runtime.training.trainer import TrainResult


def describe_pipeline(config: RunConfig) -> str:
    p = config.pipeline
    per_rank = chunks_per_rank(p.schedule, p.chunks)
    chunks = f" x {per_rank} chunks" if per_rank > 1 else ""
    tensor = f" x {p.tensor_parallel} tensor-parallel" if p.tensor_parallel > 1 else ""
    split = f" (blocks {counts_text(p.stage_blocks)})" if p.stage_blocks else ""
    return (
        f"{p.schedule}: {p.stages} stages{split}{chunks}{tensor} x {p.data_parallel} replica(s), {p.micro_batches} micro-batches "
        f"of {config.data.micro_batch_size}, {config.run.precision}"
    )


def describe(config: RunConfig) -> str:
    """The run in one line: pipeline, precision, steps, optimizer (and a curvature run's rule for
    the rest), and every setting that changes the training or its cost (curvature refresh and
    placement, ZeRO, PowerSGD, gradient workers)."""
    parts = [
        describe_pipeline(config),
        f"{config.run.steps} steps",
        f"{config.optimizer.name} lr {config.optimizer_settings.lr:g}",
    ]
    section = config.curvature
    if section is not None:
        rest = config.rest_settings
        parts.append(f"{rest.name} lr {rest.lr:g} for the rest")
        k = f"every {section.refresh_steps} steps" if section.refresh_steps else "interval chosen by the packer"
        parts.append(f"{method(config.optimizer.name).label} refresh {k}, {section.placement}")
    if config.workers_per_layer is not None:
        parts.append(f"gradient workers {config.workers_per_layer} per layer")
    if config.optimizer.zero:
        parts.append(f"ZeRO-{config.optimizer.zero}")
    if config.comm.powersgd_rank:
        start = f" from step {config.comm.powersgd_start_step}" if config.comm.powersgd_start_step else ""
        parts.append(f"PowerSGD rank {config.comm.powersgd_rank}{start}")
    return ", ".join(parts)


def _train_and_report(
    config: RunConfig, rank: int, device: torch.device, as_json: bool, resume_from: int | None
) -> int:
    """Train on this rank (rank 0 reports); the exit code (see `_reported`)."""
    from pipefisher.cli.step_report import StepReporter
    from pipefisher.runtime.training.trainer import train_pipelined

    reporter = StepReporter(config, as_json, resume_from or 0) if rank == 0 else None
    return _reported(lambda: train_pipelined(config, rank, device, on_step=reporter, resume_from=resume_from), reporter)


def _reported(train: Callable[[], TrainResult], reporter: StepReporter | None) -> int:
    """Run `train` with SIGTERM/SIGINT turned into a stop after the current step; the exit code:
    0, or 128 + signal when a signal stopped it (the reporting process says where, in one line).
    The summary only follows a completed run."""
    stop_request.install()
    try:
        result = train()
    except Stopped as stop:
        if reporter is not None:
            reporter.close(completed=False)
            print(f"pipefisher: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    except BaseException:
        if reporter is not None:
            reporter.close(completed=False)
        raise
    if reporter is not None:
        reporter.close(completed=True, state_bytes=result.state_bytes)
    return 0


def _local_worker(rank: int, world: int, config: RunConfig, as_json: bool, resume_from: int | None) -> int:
    return _train_and_report(config, rank, current_device(config.run.backend), as_json, resume_from)


def run(config: RunConfig, reference: bool, as_json: bool, resume_from: int | None = None) -> int:
    """Train; returns the process exit code: 0 success, 1 a failed run, 128 + signal when a
    signal stopped it."""
    if reference:
        return _run_reference(config, as_json)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank = int(os.environ["RANK"])
        if rank == 0:
            print(
                f"pipefisher run (torchrun): {describe(config)}; {os.environ['WORLD_SIZE']} processes", file=sys.stderr
            )
        _under_torchrun(config, lambda device: _train_and_report(config, rank, device, as_json, resume_from))
    if _refuse_missing_gpus(config):
        return 2
    store = _store(config)
    backend = resolve_backend(config.run.backend)
    print(
        f"pipefisher run: {describe(config)}; {config.world_size} processes ({backend}, port {store.port})",
        file=sys.stderr,
    )
    try:
        codes = run_group(
            _local_worker,
            config.world_size,
            args=(config, as_json, resume_from),
            backend=backend,
            timeout=config.run.timeout,
            host=config.run.master_addr,
            on_signal="forward",
            store=store,
            preload=preload_of(config.model),
        )
    except GroupFailure as failure:
        _print_failure(failure)
        return 1
    return max(codes)


def _store(config: RunConfig):
    """The local group's rendezvous store on run.master_port (0: a port the OS picks); PortInUse
    (a usage error) when the port asked for is taken."""
    return hosted_store(config.run.master_addr, config.run.master_port, config.run.timeout)


def _refuse_missing_gpus(config: RunConfig) -> bool:
    """Print a usage error if the local processes of `config` need more GPUs than this machine has."""
    problem = gpu_shortfall(config.run.backend, config.world_size)
    if problem is not None:
        print(f"pipefisher: error: {problem}", file=sys.stderr)
    return problem is not None


def _run_reference(config: RunConfig, as_json: bool) -> int:
    print(f"pipefisher run (reference, one process): {describe(config)}", file=sys.stderr)
    from pipefisher.cli.step_report import StepReporter
    from pipefisher.runtime.training.reference import train_reference

    torch.set_num_threads(1)
    reporter = StepReporter(config, as_json)
    return _reported(lambda: train_reference(config, on_step=reporter), reporter)


def _print_failure(failure: GroupFailure) -> None:
    for line in str(failure).splitlines()[: 1 + len(failure.failures)]:
        print(f"pipefisher: {line}", file=sys.stderr)


#: unmeasured steps before `pipefisher profile` measures
PROFILE_WARMUP = 1


def _profile_worker(process: int, world: int, config: RunConfig, output: str, timeline: str | None, repeats: int):
    from pipefisher.runtime.training.assembly import build_run
    from pipefisher.runtime.training.method_context import method_inputs
    from pipefisher.runtime.training.profiler import measure_profile, measured_at, records_to_timeline
    from pipefisher.runtime.training.trainer import build_executor

    device = current_device(config.run.backend)
    run = build_run(config)
    executor, schedule = build_executor(config, process, device, run)
    modules = {key: stage.module for key, stage in executor.stages.items()}
    parts = method_of(config).runtime_parts()
    timer = parts.timer(method_inputs(config), modules, parts.skip(run.model))
    profile, records = measure_profile(
        executor,
        executor.rank,
        modules,
        config.data.micro_batch_size,
        timer,
        warmup=PROFILE_WARMUP,
        repeats=repeats,
        **measured_at(config),
    )
    if process == 0:
        profile.save(output)
        if timeline:
            from pipefisher.planning.timeline_file import save_timeline

            save_timeline(
                [records_to_timeline(records, schedule.num_ranks)],
                timeline,
                name=f"{config.pipeline.schedule} measured",
            )
    return profile


def profile_run(config: RunConfig, output: str, timeline: str | None, repeats: int) -> int:
    """`pipefisher profile`: measure on local processes (or under torchrun, on the processes it
    started), write the profile (and timeline) from rank 0."""
    if "RANK" not in os.environ and _refuse_missing_gpus(config):
        return 2
    print(
        f"pipefisher profile: {describe_pipeline(config)}; {config.world_size} processes; {PROFILE_WARMUP} warm-up and "
        f"{repeats} measured steps (gradients dropped), then the end of step and every {method_of(config).label} task timed alone",
        file=sys.stderr,
    )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank = int(os.environ["RANK"])

        def work(device: torch.device) -> int:
            _profile_worker(rank, config.world_size, config, output, timeline, repeats)
            # only rank 0 writes the file (on its own node)
            return _report_profile(load_profile(output), output, timeline) if rank == 0 else 0

        _under_torchrun(config, work)
    store = _store(config)
    try:
        profiles = run_group(
            _profile_worker,
            config.world_size,
            args=(config, output, timeline, repeats),
            backend=resolve_backend(config.run.backend),
            timeout=config.run.timeout,
            host=config.run.master_addr,
            on_signal="kill",
            store=store,
            preload=preload_of(config.model),
        )
    except GroupFailure as failure:
        _print_failure(failure)
        return 1
    except Interrupted as interrupted:
        print(f"pipefisher: {interrupted}", file=sys.stderr)
        return interrupted.exit_code
    return _report_profile(profiles[0], output, timeline)


def _report_profile(profile, output: str, timeline: str | None) -> int:
    rules = method(profile.method).rules
    labels = rules.labels
    for index, stage in enumerate(profile.stages):
        weight = f" (weight gradient {stage.weight:.3f} ms)" if stage.weight else ""
        own = f" ({labels.method}'s work {stage.method_step_end:.3f} ms)" if stage.method_step_end else ""
        folds = sum(layer.fold for layer in stage.layers)
        fold = f", {labels.fold} {folds:.3f} ms" if rules.deferred_statistics else ""
        print(
            f"stage {index}: forward {stage.forward:.3f} ms, backward {stage.backward:.3f} ms{weight}, p2p {stage.p2p:.3f} ms, "
            f"gradient all-reduce {stage.grad_reduce:.3f} ms, step end {stage.step_end:.3f} ms{own}, "
            f"{len(stage.layers)} {labels.method} layers: curvature {stage.curvature_time:.3f} ms per micro-batch, "
            f"{labels.refreshes} {stage.refresh_time:.3f} ms, {labels.precondition} "
            f"{sum(layer.precondition for layer in stage.layers):.3f} ms{fold}"
        )
    for line in flop_report(profile):
        print(line)
    print(f"wrote {output}" + (f" and {timeline}" if timeline else ""))
    return 0


def _under_torchrun(config: RunConfig, work: Callable[[torch.device], int]) -> NoReturn:
    """Run `work(device)` in the process group torchrun's environment describes; exit with its
    code."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.world_size:
        print(
            f"pipefisher: error: torchrun started {world} processes; the run needs {config.world_size} "
            f"(pipeline.stages x pipeline.data_parallel x pipeline.tensor_parallel)",
            file=sys.stderr,
        )
        sys.exit(2)
    problem = tensor_parallel_placement(config.pipeline.tensor_parallel, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if problem is not None:
        print(f"pipefisher: error: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        code = work(init_distributed(config.run.backend, config.run.timeout))
    except Exception as exc:
        print(f"pipefisher: rank {rank}: {first_line(exc)}", file=sys.stderr, flush=True)
        code = 1  # peers are failing too; a clean shutdown could wait on them
    # Leave at once, like the local launcher's workers: left to interpreter exit, the process
    # group's threads can abort the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def tensor_parallel_placement(degree: int, per_node: int) -> str | None:
    """Why `per_node` processes per node cannot hold whole tensor-parallel groups of `degree`
    processes, if they cannot. Processes of a rank are consecutive (`pipefisher.core.topology`), so
    torchrun keeps them on one node exactly when its processes per node are a multiple of `degree`."""
    if per_node % degree == 0:
        return None
    return (
        f"pipeline.tensor_parallel: the {degree} processes of a rank all-reduce inside every forward and backward and must "
        f"share a node; torchrun starts {per_node} per node: make --nproc-per-node a multiple of {degree}"
    )


def check_port(config: RunConfig) -> str | None:
    """An error message if the local launcher could not use the configured port."""
    if "RANK" in os.environ or config.run.master_port == 0:
        return None
    if port_in_use(config.run.master_port, config.run.master_addr):
        return str(PortInUse(config.run.master_port, config.run.master_addr))
    return None
