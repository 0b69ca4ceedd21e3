"""A curvature method's torch side: the interface every method implements (`MethodParts`).

The plan says which op runs where (`pipefisher.methods.method`); a method's runtime supplies the
handlers of its op kinds, the launchers of its collectives (``sync``, ``exchange``), its hooks
into the step (around forwards, after backwards, before the optimizer step), its end-of-cycle
commit and its checkpoint state. Its `TaskTimer` measures its tasks for the profiler.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from torch import Tensor, nn
from torch.optim import Optimizer

from pipefisher.core.ir import Op, OpKind, splits_backward
from pipefisher.core.topology import Topology
from pipefisher.methods.inputs import MethodInputs
from pipefisher.planning.comm.actions import Collective, CollectiveKind
from pipefisher.planning.comm.plan import inverse_owners
from pipefisher.planning.plan import Plan
from pipefisher.runtime.primitives.comm import Comm, Handle

#: (time key -> samples in ms, part -> bytes of one micro-batch's capture) of one layer; the time
#: keys are `pipefisher.core.profile.time_key`s (``refresh.1``), those of the method's
#: `TaskRules.timed_fields`
LayerMeasurement = tuple[dict[str, list[float]], dict[int, int]]


def tied_copies(model) -> tuple[str, ...]:
    """Globs of `model`'s tied weights' copies (a head tied to an embedding). Their gradient is
    whole only after the tied sum at the end of the step, so a method that preconditions during
    the step skips them (`MethodParts.skip`) and a first-order rule steps them."""
    return tuple(sorted({f"*{name}" for _, name in model.tied_parameters()}))


def broadcast_from_owner(
    comm: Comm,
    topology: Topology,
    rank: int,
    owner_pipe: int,
    collective: Collective,
    shared: Callable[[], Tensor],
    buffer: Callable[[], Tensor],
    receive: Callable[[Tensor], None],
    sent: Callable[[], None] | None = None,
) -> Handle:
    """An exchange: the refresh result of `collective.key` = (stage, layer, part) (an inverse, a
    root) goes from the owner pipe's rank of data-parallel replica 0 (`shared()`; `sent()` runs
    there once it is out) to the stage's other replicas, which receive into `buffer()` and hand it
    to `receive` once it arrived."""
    stage = collective.key[0]
    source = topology.rank(0, owner_pipe, stage)
    if rank == source:
        return comm.broadcast([(shared(), source)], collective.group, on_done=sent)
    target = buffer()
    return comm.broadcast([(target, source)], collective.group, on_done=lambda: receive(target))


class CurvatureEngine(Protocol):
    """A method's state over one stage: what a checkpoint saves and restores."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CurvatureRuntime:
    """One rank's state of a curvature method over its stages, and its part in every step."""

    #: its engines by (pipe, stage)
    engines: Mapping[tuple[int, int], CurvatureEngine]
    #: keys of an engine's state dict ("" = the state dict itself) whose values are dicts keyed by
    #: a layer's or parameter's global name: a layout-free checkpoint keeps those entries by name.
    #: The rest of an engine's state dict must be equal on every engine, shard and replica.
    named_sections: tuple[str, ...] = ("",)
    #: keys of such an entry ("*/key": that key of every dict in the entry) that hold the work of
    #: an unfinished refresh cycle: carried over only to a resumption on the same layout
    cycle_slots: tuple[str, ...] = ()
    #: keys of such an entry that only a rank that `keeps` the layer's refresh results holds
    result_slots: tuple[str, ...] = ()

    def handlers(self) -> dict[OpKind, Callable[[Op], None]]:
        """Handlers of the method's op kinds."""
        raise NotImplementedError

    def collectives(self) -> dict[CollectiveKind, Callable[[Collective], Handle]]:
        """Launchers of its collectives by kind (SYNC, EXCHANGE)."""
        raise NotImplementedError

    def forward_context(self, op: Op, cycle_step: int) -> AbstractContextManager:
        """Context the forward `op` runs in (K-FAC records its inputs in the cycle's first step)."""
        return nullcontext()

    def after_backward(self, op: Op, cycle_step: int) -> None:
        """Called after every backward (Shampoo keeps the stage's gradient of the cycle's first step)."""

    def before_optimizer_step(self, updates: Callable[[nn.Parameter], bool]) -> None:
        """Called on the reduced, clipped gradients right before the optimizer step (Shampoo
        preconditions there) with the test of the parameters this rank updates (ZeRO-1: only
        their gradients are reduced here); not called when fp16 overflowed."""

    def set_plan(self, plan: Plan) -> None:
        """Use `plan` from the next cycle on (its owners decide who computes what)."""

    def end_of_cycle(self) -> None:
        """Make the cycle's refresh results the ones in use."""
        raise NotImplementedError

    def keeps(self, stage: int, name: str) -> bool:
        """Whether this rank keeps the refresh results of `stage`'s layer or matrix `name` (False
        on a replica that is not one of its gradient workers): a checkpoint takes them from one that does."""
        return True

    def cycle_state(self) -> dict:
        """Its state outside the engines that belongs to the refresh cycle in progress (tied to
        this rank's layout: a checkpoint keeps it for a resumption on the same layout only)."""
        return {}

    def load_cycle_state(self, state: dict) -> None:
        """Restore :meth:`cycle_state` output."""

    def state_dict(self) -> dict:
        """Every engine's state by "<pipe>.<stage>" and the cycle's state (for byte counts)."""
        return {
            "engines": {f"{pipe}.{stage}": engine.state_dict() for (pipe, stage), engine in self.engines.items()},
            "cycle": self.cycle_state(),
        }


E = TypeVar("E", bound=CurvatureEngine)


class StageRuntime(CurvatureRuntime, Generic[E]):
    """The constructor and bookkeeping every method's runtime repeats, as a base class: subclass
    it, define `build_engine` (one engine per (pipe, stage) this rank holds), `handlers`,
    `collectives` and `end_of_cycle`; call `stage_gradient_final` from `after_backward` to act
    once a stage's gradient of the step is whole; use `owner`/`owns` (who computes a part's refresh
    work, from the plan) and `broadcast`/`all_reduce` (an exchange, a sync) in the handlers.

    Its constructor is `MethodParts.runtime`'s signature: `config` (`MethodInputs`: the method's
    section and the run's facts), `topology`, `rank`, `modules` ((pipe, stage) -> the stage's
    module), `comm`, the first `plan` (None: no owners), `skip` (`MethodParts.skip` globs) and
    `loss_scale()` (fp16's current loss scale, None otherwise)."""

    def __init__(
        self,
        config: MethodInputs[Any],
        topology: Topology,
        rank: int,
        modules: dict[tuple[int, int], nn.Module],
        comm: Comm,
        plan: Plan | None,
        skip: tuple[str, ...] = (),
        loss_scale: Callable[[], Tensor | None] = lambda: None,
    ) -> None:
        self.config, self.topology, self.rank, self.comm, self.loss_scale = config, topology, rank, comm, loss_scale
        self.modules = modules
        self.engines: dict[tuple[int, int], E] = {
            key: self.build_engine(config, module, skip) for key, module in modules.items()
        }
        #: a rank holds at most one copy of a stage
        self.engine_of_stage: dict[int, E] = {stage: engine for (_, stage), engine in self.engines.items()}
        ops = topology.schedule.ranks[topology.pipeline_rank(rank)]
        self._final_kind = OpKind.WEIGHT if splits_backward(ops) else OpKind.BACKWARD
        self._gradient_ops = Counter((op.pipe, op.stage) for op in ops if op.kind is self._final_kind)
        self._gradient_ops_run: Counter[tuple[int, int]] = Counter()
        self.owners: dict[tuple[int, str, int], int] = {}
        self.set_plan(plan)

    #: what the engine calls part i in its methods (the built-ins: "A", "B"); () = the index itself
    engine_parts: tuple[str, ...] = ()

    def build_engine(self, config: MethodInputs[Any], module: nn.Module, skip: tuple[str, ...]) -> E:
        """The method's engine of one stage's `module` (its layers not matching `skip`)."""
        raise NotImplementedError

    def engine(self, op: Op) -> E:
        """The engine of `op`'s (pipe, stage)."""
        return self.engines[(op.pipe, op.stage)]

    def set_plan(self, plan: Plan | None) -> None:
        self.owners = inverse_owners(plan) if plan is not None else {}

    def owner(self, stage: int, layer: str, part: int) -> int:
        """The pipe whose replica 0 computes the refresh work of (`stage`, `layer`, `part`)."""
        return self.owners[(stage, layer, part)]

    def owns(self, op: Op, part: int) -> bool:
        """Whether `op` (a refresh op, an X) runs on the pipe that computes `part` of its layer; an X
        on another pipe folds the synced statistic and receives the result by `broadcast`."""
        return op.layer is not None and self.owner(op.stage, op.layer, part) == op.pipe

    def stage_gradient_final(self, op: Op) -> bool:
        """Call from `after_backward` with every backward op: True at the op after which the
        stage's gradient of the step is whole (its last backward, or weight op on a schedule that
        splits the backward), False otherwise."""
        key = (op.pipe, op.stage)
        if op.kind is not self._final_kind:
            return False
        self._gradient_ops_run[key] += 1
        if self._gradient_ops_run[key] < self._gradient_ops[key]:
            return False
        self._gradient_ops_run[key] = 0
        return True

    def all_reduce(self, collective: Collective, tensors: list[Tensor]) -> Handle:
        """A sync: sum `tensors` in place over the replicas of the stage (`collective.group`)."""
        return self.comm.all_reduce(tensors, collective.group)

    def broadcast(
        self,
        collective: Collective,
        shared: Callable[[], Tensor],
        buffer: Callable[[], Tensor],
        receive: Callable[[Tensor], None],
        sent: Callable[[], None] | None = None,
    ) -> Handle:
        """An exchange of `collective.key` = (stage, layer, part) from its owner
        (`broadcast_from_owner`)."""
        stage, layer, part = collective.key
        owner = self.owner(stage, layer, part)
        return broadcast_from_owner(
            self.comm, self.topology, self.rank, owner, collective, shared, buffer, receive, sent
        )

    def exchange(
        self,
        collective: Collective,
        shared: Callable[[E, str, Any], Tensor],
        buffer: Callable[[E, str, Any], Tensor],
        receive: Callable[[E, str, Any, Tensor], None],
    ) -> Handle:
        """`broadcast` of a result the stage's engine holds: `shared(engine, layer, part)` on the
        owner, `buffer(engine, layer, part)` elsewhere, then `receive(engine, layer, part, tensor)`
        (the engine class's methods fit: `ShampooEngine.shared_root`); `part` as the engine names
        it (`engine_parts`)."""
        stage, layer, index = collective.key
        part = self.engine_parts[index] if self.engine_parts else index
        engine = self.engine_of_stage[stage]
        return self.broadcast(
            collective,
            shared=lambda: shared(engine, layer, part),
            buffer=lambda: buffer(engine, layer, part),
            receive=lambda tensor: receive(engine, layer, part, tensor),
        )


class TaskTimer:
    """Measures a method's tasks for the profiler on one rank; `method` names it (`Profile.method`);
    `config`: the run as the method sees it, whose section and micro-batch tokens the method's
    flop counts read (None: no counts)."""

    method: str = ""  # its `CurvatureMethod.name`
    config: MethodInputs[Any] | None = None

    def forward_context(self, op: Op) -> AbstractContextManager:
        """Context of the forwards of the profiler's last measured step (K-FAC captures there)."""
        return nullcontext()

    def before_optimizer_step(self) -> None:
        """The method's per-step work before the optimizer step, timed as part of the step end."""

    @property
    def step_end_work(self) -> bool:
        """Whether `before_optimizer_step` works on this rank (after `measure`), which the profiler
        then times as `StageProfile.method_step_end`; default: where the class defines the hook."""
        return type(self).before_optimizer_step is not TaskTimer.before_optimizer_step

    def measure(self, executor) -> dict[tuple[int, str], LayerMeasurement]:
        """(stage, layer) -> its task time samples in ms and capture sizes, for the stages this
        rank holds. Collective over the ranks (syncs are timed on the stages' groups)."""
        raise NotImplementedError


class StageTimer(TaskTimer, Generic[E]):
    """A `TaskTimer` over throwaway engines, one per (pipe, stage) of `modules`, built as the
    runtime builds them (`build_engine`); its constructor is `MethodParts.timer`'s signature."""

    def __init__(
        self, config: MethodInputs[Any], modules: dict[tuple[int, int], nn.Module], skip: tuple[str, ...] = ()
    ):
        self.config, self.modules = config, modules
        self.engines: dict[tuple[int, int], E] = {
            key: self.build_engine(config, module, skip) for key, module in modules.items()
        }

    def build_engine(self, config: MethodInputs[Any], module: nn.Module, skip: tuple[str, ...]) -> E:
        """The engine of one stage's `module`, as the runtime's."""
        raise NotImplementedError

    def by_stage(self) -> list[tuple[int, int, E]]:
        """(pipe, stage, engine) of every engine, by stage, then pipe (the order `measure` times them)."""
        return [(pipe, stage, engine) for (pipe, stage), engine in sorted(self.engines.items(), key=_stage_first)]

    @staticmethod
    def sync_group(executor: Any, stage: int) -> Any:
        """The process group of `stage`'s syncs (None: the stage has no other replica)."""
        return executor.comm.groups.get(("curv", stage))


def _stage_first(item: tuple[tuple[int, int], Any]) -> tuple[int, int]:
    (pipe, stage), _ = item
    return stage, pipe


class ReferenceCurvature:
    """A curvature method of the whole model in one process (the reference twin of its runtime),
    with the pipeline's cycle semantics: refresh cycles of `refresh_steps` (`self.k`), new refresh
    results committed after a cycle's last step. `config`: `MethodInputs`; `model`: the run's
    `StagedModel`; `modules`: what the reference trains (an ``nn.ModuleList`` of the stages, so a
    parameter's name is its stage's prefixed by "<stage>.": globs of `MethodParts.skip` match it
    with a leading "*." (`pipefisher.methods.layers.whole_model_globs`)).

    Hooks, in the order `pipefisher run --reference` calls them in a step:

    - `capture(step, micro_batch, loss_scale)` around each micro-batch's forward and backward
      (`loss_scale`: fp16's scale of that micro-batch's loss, None otherwise);
    - `after_step_backwards(step)` once every micro-batch's backward ran: raw gradients, before
      the tied sum and clipping (where the pipeline's per-stage work, P ops included, sees them);
    - `before_optimizer_update(step)` on the summed, clipped gradients right before the optimizer
      step (not on an fp16 overflow);
    - `after_optimizer_step(step)`."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "before_optimizer_step" in vars(cls):
            raise TypeError(
                f"{cls.__name__}.before_optimizer_step: the reference's hook after the backwards is "
                "`after_step_backwards(step)` (renamed in method API v1; `before_optimizer_step` is the runtime's)"
            )

    #: whether it has refresh cycles (False: every step alike, `refresh_steps` not needed)
    refreshes: bool = True

    def __init__(self, config: MethodInputs[Any], model: Any, modules: nn.Module) -> None:
        name, steps = config.name, config.settings.refresh_steps
        if self.refreshes and steps < 1:
            raise ValueError(
                f"the reference {name} needs {name}.refresh_steps (--{name}-refresh-steps): it has no packer"
            )
        #: the refresh interval: step s is the first of its cycle when s % k == 0, the last when s % k == k - 1
        self.k: int = max(steps, 1)

    def first_of_cycle(self, step: int) -> bool:
        """Whether `step` is the first of its refresh cycle."""
        return step % self.k == 0

    def last_of_cycle(self, step: int) -> bool:
        """Whether `step` is the last of its refresh cycle (its results are committed after it)."""
        return step % self.k == self.k - 1

    def capture(self, step: int, micro_batch: int, loss_scale: Tensor | None = None) -> AbstractContextManager:
        """Context around micro-batch `micro_batch`'s forward and backward of `step`."""
        return nullcontext()

    def after_step_backwards(self, step: int) -> None:
        """After the step's backwards, on the raw gradients (before the tied sum and clipping)."""

    def before_optimizer_update(self, step: int) -> None:
        """On the clipped gradients right before the optimizer step."""

    def after_optimizer_step(self, step: int) -> None:
        """After the optimizer step (commit a cycle's results at its last step)."""


@dataclass(frozen=True)
class MethodParts:
    """The torch side of a curvature method (`CurvatureMethod.parts` names it).

    `runtime(inputs, topology, rank, modules, comm, plan, skip, loss_scale)`: one rank's
    `CurvatureRuntime` over its stages' `modules` ((pipe, stage) -> module); `timer(inputs,
    modules, skip)`: its `TaskTimer`; `layer_names(stage module, skip)`: the layers its tasks
    name, in order; `skip(staged model)`: globs of what stays first-order; `reference(inputs,
    model, modules)`: its `ReferenceCurvature`. `inputs`: the run as the method sees it
    (`MethodInputs`: its section and the run's facts; the method imports no `pipefisher.config`).

    `preconditioned(config, module, skip)` (`config`: the run file, read as its sections): names (as `module.named_parameters()` gives them) of
    the parameters of `module` (a stage, or the reference's whole model) whose update the method
    owns in the run `config`: the ones whose ``.grad`` it rewrites, stepped by its `optimizer`; every
    other parameter is stepped by the section's `first_order` rule (`pipefisher.optim.build_optimizer`).
    `optimizer(config, param_groups)`: the update rule of those parameters, a torch optimizer over
    `param_groups` (decayed and undecayed groups, each with its ``weight_decay``; a parameter whose
    ``.grad`` is None must be left alone); None: SGD at the section's lr and momentum
    (`RunConfig.optimizer_settings`), stepping the gradient the method wrote."""

    runtime: Callable[..., CurvatureRuntime]
    timer: Callable[[MethodInputs[Any], dict, tuple[str, ...]], TaskTimer]
    layer_names: Callable[[nn.Module, tuple[str, ...]], list[str]]
    skip: Callable[[Any], tuple[str, ...]]
    reference: Callable[[MethodInputs[Any], Any, nn.Module], ReferenceCurvature]
    preconditioned: Callable[[Any, nn.Module, tuple[str, ...]], list[str]]
    optimizer: Callable[[Any, list[dict]], Optimizer] | None = None
