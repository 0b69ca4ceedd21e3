"""A process's training state under layout-free keys, and back: what lets a checkpoint resume on
any stages, schedule, data parallelism, ZeRO and method placement of the same model.

Keys ("/"-separated; a stage's parameter names are the unsplit model's, `pipefisher.models.init`):

- ``model/<name>``: a parameter or buffer;
- ``optimizer/<part>/<name>``: a parameter's first-order optimizer state (part ``all``, or a
  curvature run's ``method`` and ``rest``), written by the replica that updates it (ZeRO-1: its owner);
- ``curvature/<section>/<name>``: a curvature engine's entry for a layer, matrix or parameter
  (`CurvatureRuntime.named_sections`) without its unfinished cycle's slots; ``curvature/rest``:
  an engine's state outside those sections (e.g. Shampoo's step count);
- ``run/<what>``: the scheduler's position, the loss scaler, the refresh cycle's position, the profile;
- ``local/<process>/<kind>/…``: what is tied to the layout (random streams, PowerSGD's state;
  inside a refresh cycle the process's own whole curvature entries), used only by a resumption
  on the same layout.

ZeRO-2/3's sharded parameters and their optimizer state are saved whole (gathered over the
stage's replicas) and loaded as the run's shards: the keys do not change with the ZeRO degree.
Under tensor parallelism a shard's keys end in ``@<shard>`` (the degree is part of the identity).
Replicas hold equal values, so each key is written once (`entries_to_write` says by whom).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.config import RunConfig
from pipefisher.models.init import derive_seed
from pipefisher.runtime.gradient_path.sharded import gathered, like, like_parameter
from pipefisher.runtime.primitives.sharding import full
from pipefisher.runtime.training.optimizer import build_scheduler
from pipefisher.optim.composite import Composite
from pipefisher.runtime.pipeline.executor import Executor
from pipefisher.runtime.pipeline.plan_runner import PlanRunner
from pipefisher.runtime.training.checkpoint import StateReader

if TYPE_CHECKING:
    from pipefisher.methods.interface import CurvatureRuntime
    from pipefisher.runtime.training.pipefisher_run import PipeFisherTrainer

#: the key of an engine's state outside its named sections
REST = "curvature/rest"


def tied_aliases(model) -> dict[str, str]:
    """A tied weight's name -> its other copy's (both ways), from `model.tied_parameters()`."""
    names = [name for _, name in model.tied_parameters()]
    return {a: b for a in names for b in names if a != b}


def _suffix(executor: Executor) -> str:
    return f"@{executor.comm.shard}" if executor.topology.tensor_parallel > 1 else ""


def _stage_key(pipe: int, stage: int) -> str:
    return f"{pipe}.{stage}"


def _trainer(runner: PlanRunner) -> PipeFisherTrainer | None:
    """`runner` when it trains with a curvature method (a `PipeFisherTrainer`, told by its method
    runtime: importing the class here would be a cycle), else None."""
    return cast("PipeFisherTrainer", runner) if getattr(runner, "runtime", None) is not None else None


def _curvature(runner: PlanRunner) -> CurvatureRuntime | None:
    trainer = _trainer(runner)
    return None if trainer is None else trainer.runtime


def _optimizer_parts(optimizer: torch.optim.Optimizer) -> dict[str, torch.optim.Optimizer]:
    return dict(optimizer.parts) if isinstance(optimizer, Composite) else {"all": optimizer}


def _parameter_names(modules: Iterable[nn.Module]) -> dict[int, str]:
    """id(parameter) -> its global name, over this process's stages."""
    return {id(p): name for module in modules for name, p in module.named_parameters()}


def _indexed(part: torch.optim.Optimizer) -> list[nn.Parameter]:
    """A torch optimizer's parameters in its state dict's index order."""
    return [p for group in part.param_groups for p in group["params"]]


def _split_slots(entry: Any, slots: tuple[str, ...]) -> tuple[Any, dict[tuple[Any, str], Any]]:
    """(the entry without `slots`, {(inner key or None, slot): value} of those it holds); a slot
    "*/key" is that key of every dict in the entry."""
    if not isinstance(entry, dict) or not slots:
        return entry, {}
    kept, taken = dict(entry), {}
    for slot in slots:
        head, _, key = slot.rpartition("/")
        inner = [name for name, value in entry.items() if isinstance(value, dict)] if head == "*" else [None]
        for name in inner:
            if name is not None and kept[name] is entry[name]:
                kept[name] = dict(entry[name])  # a copy: the engine's own dict stays whole
            holder = kept if name is None else kept[name]
            if key in holder:
                taken[(name, key)] = holder.pop(key)
    return kept, taken


def _put_slots(entry: dict, taken: dict[tuple[Any, str], Any]) -> dict:
    """`entry` with the slots `_split_slots` took put back."""
    entry = dict(entry)
    for (name, key), value in taken.items():
        if name is None:
            entry[key] = value
        else:
            entry[name] = {**entry[name], key: value}
    return entry


def _with_slots_of(entry: Any, template: Any, slots: tuple[str, ...]) -> Any:
    """`entry` with its `slots` as in `template` (a fresh engine's entry)."""
    if not isinstance(entry, dict) or not isinstance(template, dict):
        return entry
    return _put_slots(_split_slots(entry, slots)[0], _split_slots(template, slots)[1])


def process_state(executor: Executor, runner: PlanRunner, process: int) -> dict[str, Any]:
    """Everything process `process` holds that a run continues from, under layout-free keys (call
    after `runner.quiesce()`). A parameter in its optimizer without state yet has an empty entry."""
    suffix, entries = _suffix(executor), dict[str, Any]()
    modules = [runtime.module for runtime in executor.stages.values()]
    for module in modules:
        entries.update({f"model/{name}{suffix}": full(value) for name, value in module.state_dict().items()})
    names = _parameter_names(modules)
    for part_name, part in _optimizer_parts(executor.optimizer).items():
        state = part.state_dict()["state"]
        for index, parameter in enumerate(_indexed(part)):
            entries[f"optimizer/{part_name}/{names[id(parameter)]}{suffix}"] = gathered(state.get(index, {}))
    scheduler, scaler = executor.scheduler, executor.step_end.scaler
    entries["run/scheduler_step"] = scheduler.last_epoch if scheduler is not None else None
    entries["run/loss_scaler"] = scaler.state_dict() if scaler is not None else None
    local = f"local/{process}"
    entries[f"{local}/rng/host"] = torch.random.get_rng_state()
    if executor.device.type == "cuda":
        entries[f"{local}/rng/device"] = torch.cuda.get_rng_state(executor.device)
    reduction = executor.step_end.reduction
    for (pipe, stage), state in reduction.state_dict().items():
        entries[f"{local}/{reduction.section}/{_stage_key(pipe, stage)}"] = state
    trainer = _trainer(runner)
    if trainer is not None:
        runtime = trainer.runtime
        entries["run/cycle_step"] = trainer.cycle_step
        entries["run/profile"] = trainer.profile.to_dict()
        entries["run/helpers"] = trainer.section.helpers  # false once the run dropped its help ops
        entries[f"{local}/cycle/runtime"] = runtime.cycle_state()
        entries.update(_curvature_entries(runtime, f"{local}/cycle", suffix, trainer.cycle_step != 0))
    return entries


def _curvature_entries(runtime: CurvatureRuntime, local: str, suffix: str, mid_cycle: bool) -> dict[str, Any]:
    """Each engine's named entries without their cycle slots under global keys; inside a cycle
    also this process's whole entry under its own key: replicas part way through a cycle differ
    (one has folded a factor another has not yet received). At a cycle's boundary the slots hold
    no work (a resumption takes them from a fresh engine)."""
    entries: dict[str, Any] = {}
    for (pipe, stage), engine in runtime.engines.items():
        state = engine.state_dict()
        for section in runtime.named_sections:
            prefix = f"{section}/" if section else ""
            for name, entry in (state[section] if section else state).items():
                entries[f"curvature/{prefix}{name}{suffix}"] = _split_slots(entry, runtime.cycle_slots)[0]
                if mid_cycle:
                    entries[f"{local}/{_stage_key(pipe, stage)}/{prefix}{name}"] = entry
        entries.setdefault(
            REST,
            {key: value for key, value in state.items() if key not in runtime.named_sections}
            if "" not in runtime.named_sections
            else {},
        )
    return entries


def _write_priority(executor: Executor, runner: PlanRunner, keys: Iterable[str]) -> dict[str, int]:
    """Per key, 0 where this process holds the entry as its updater does, else 1: a replica that
    does not update a parameter (ZeRO-1) may hold stale state for it, and one that does not keep
    a layer's refresh results (`CurvatureRuntime.keeps`: not its gradient worker) lacks them."""
    first: dict[str, nn.Parameter] = {}
    stage_of: dict[str, int] = {}
    for (_, stage), runtime in executor.stages.items():
        for name, module in runtime.module.named_modules():
            own = next(module.parameters(recurse=False), None)
            if own is not None:
                first.setdefault(name, own)
                stage_of[name] = stage
        for name, parameter in runtime.module.named_parameters(remove_duplicate=False):
            first[name], stage_of[name] = parameter, stage
    updates, curvature = executor.step_end.applies_to, _curvature(runner)
    priority = {}
    for key in keys:
        name = key.rpartition("/")[2].partition("@")[0]
        found = first.get(name)
        kept = (
            curvature is None
            or not key.startswith("curvature/")
            or name not in stage_of
            or curvature.keeps(stage_of[name], name)
        )
        priority[key] = 0 if kept and (found is None or updates(found)) else 1
    return priority


def entries_to_write(executor: Executor, runner: PlanRunner, entries: dict[str, Any]) -> dict[str, Any]:
    """This process's share of `entries` (`process_state`): its own layout-tied entries, and every
    shared key it is the writer of, the holder with the lowest (write priority, process), so each
    key is written once. Collective over the world (an all-gather of the keys)."""
    shared = _write_priority(executor, runner, [key for key in entries if not key.startswith("local/")])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shared)
    writer: dict[str, tuple[int, int]] = {}
    for holder, priorities in enumerate(everyone):
        for key, priority in priorities.items():
            writer[key] = min(writer.get(key, (priority, holder)), (priority, holder))
    process = dist.get_rank()
    return {key: value for key, value in entries.items() if key.startswith("local/") or writer[key][1] == process}


def restore_executor(
    executor: Executor, reader: StateReader, config: RunConfig, process: int, same_processes: bool
) -> None:
    """Load this process's parameters, optimizer state, loss scaler and schedule position from
    `reader`; with the same processes also its random streams and PowerSGD state, else streams
    re-seeded from (seed, rank, step). KeyError naming an entry the checkpoint lacks."""
    suffix = _suffix(executor)
    modules = [runtime.module for runtime in executor.stages.values()]
    for module in modules:
        module.load_state_dict(
            {name: like(reader.required(f"model/{name}{suffix}"), value) for name, value in module.state_dict().items()}
        )
    names = _parameter_names(modules)
    for part_name, part in _optimizer_parts(executor.optimizer).items():
        state = part.state_dict()
        for index, parameter in enumerate(_indexed(part)):
            entry = reader.required(f"optimizer/{part_name}/{names[id(parameter)]}{suffix}")
            if entry:
                state["state"][index] = like_parameter(entry, parameter)
        part.load_state_dict(state)
    if executor.step_end.scaler is not None:
        executor.step_end.scaler.load_state_dict(reader.required("run/loss_scaler"))
    position = reader.get("run/scheduler_step")
    if executor.scheduler is not None and position is not None:
        # The schedule comes from this run's configuration; only its position is restored, by a
        # scheduler that starts there (stepping one before any optimizer step would warn).
        executor.step_end.scheduler = build_scheduler(config, executor.optimizer, position=position)
    local = f"local/{process}"
    if not same_processes:
        torch.manual_seed(derive_seed(config.run.seed, f"rank/{executor.rank}/step/{reader.manifest['step']}"))
        return
    torch.random.set_rng_state(reader.required(f"{local}/rng/host"))
    device_state = reader.get(f"{local}/rng/device")
    if device_state is not None and executor.device.type == "cuda":
        torch.cuda.set_rng_state(device_state, executor.device)
    reduction = executor.step_end.reduction
    reduction.load_state_dict(
        {
            (pipe, stage): reader.required(f"{local}/{reduction.section}/{_stage_key(pipe, stage)}")
            for pipe, stage in reduction.state_dict()
        }
    )


def restore_curvature(runner: PipeFisherTrainer, reader: StateReader, process: int, same_layout: bool) -> None:
    """Load the curvature engines of `runner` from `reader`: each engine's named entries that
    belong to its stage, without the refresh results of a layer this rank does not keep. On the
    same layout a process's own whole entries and the cycle's position come back; on another the
    cycle starts anew (the cycle slots as a fresh engine's)."""
    runtime, suffix = runner.runtime, _suffix(runner.executor)
    local = f"local/{process}/cycle"
    rest = reader.get(REST, {})
    for (pipe, stage), engine in runtime.engines.items():
        fresh = engine.state_dict()
        module = runner.modules[(pipe, stage)]
        owned = {name for name, _ in module.named_modules()} | {
            name for name, _ in module.named_parameters(remove_duplicate=False)
        }
        state = {**fresh, **rest}
        for section in runtime.named_sections:
            prefix = f"curvature/{section}/" if section else "curvature/"
            template = fresh[section] if section else fresh
            saved = {
                key[len(prefix) : len(key) - len(suffix)] for key in reader.keys(prefix) if key.endswith(suffix)
            } & owned
            entries = {}
            for name in sorted(saved | set(template)):
                own = (
                    reader.get(f"{local}/{_stage_key(pipe, stage)}/{section + '/' if section else ''}{name}")
                    if same_layout
                    else None
                )
                if own is not None:
                    entries[name] = own
                    continue
                entry = _with_slots_of(
                    reader.get(f"{prefix}{name}{suffix}", template.get(name)), template.get(name), runtime.cycle_slots
                )
                if not runtime.keeps(stage, name):
                    if not isinstance(entry, dict):
                        continue  # its whole state is a refresh result it does not keep
                    entry = _with_slots_of(entry, template.get(name), runtime.result_slots)
                entries[name] = entry
            if section:
                state[section] = entries
            else:
                state = entries
        engine.load_state_dict(state)
    if same_layout:
        runner.cycle_step = int(reader.required("run/cycle_step"))
        runtime.load_cycle_state(reader.required(f"{local}/runtime"))
