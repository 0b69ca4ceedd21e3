"""The task vocabulary a curvature method speaks to planning: its `TaskRules` and `WorkLabels`.
Each method's declaration (`pipefisher.methods.method.CurvatureMethod`) builds them; planning,
plans, the NCCL-order check, the simulator, reports and viz read them and know no method by name.
Pure Python: no torch.

A layer's refresh work has *parts* 0..n-1 (K-FAC's input and output-gradient factors, Shampoo's
left and right roots, SOAP's left and right eigenbases; one for a diagonal method; none for a
method whose work recurs every step, which is then its P op alone), and per part:

- curvature (`OpKind.CURVATURE`) per micro-batch, for methods whose statistics are sums over
  micro-batches: part 0 reads the micro-batch's forward (inputs), part 1 its backward (output
  gradients);
- a sync (`OpKind.SYNC`), an all-reduce of its input over the stage's replicas (pipes x
  data-parallel);
- refresh work (`OpKind.REFRESH`: K-FAC's damped inverse, Shampoo's inverse root, SOAP's basis);
- an exchange X per layer when the refresh work is split among the replicas;
- a precondition P per stage in every step, for methods that precondition before the gradient
  reduction (a method that needs the reduced gradient preconditions in the optimizer step);
- a fold U per stage in every step, for methods that fold each step's final gradient into their
  statistics (SOAP): deferred from that step's end into the next step's bubbles; its time is its
  layers' profile `fold` times, as the P op's is their `precondition` times.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipefisher.core.profile import PART_WORK, time_key
from pipefisher.core.tensor_parallel import TensorParallelPlan, split_of

#: the most parts a layer's work may have
MAX_PARTS = 2


@dataclass(frozen=True)
class WorkLabels:
    """What a method calls its work in reports, tables and pictures: `method` (its name there,
    e.g. "K-FAC"), `parts` (one label per part, e.g. ("A factor", "B factor"); their number is the
    method's number of parts), `refresh` (a part's refresh work, singular: "inverse", "root",
    "basis"), `precondition` (its per-step work: "precondition", Muon's "orthogonalisation"),
    `fold` (its per-step fold of the gradient into its statistics, the U op's work of a method
    with `TaskRules.deferred_statistics`)."""

    parts: tuple[str, ...]
    refresh: str = "refresh"
    precondition: str = "preconditioning"
    method: str = ""
    fold: str = "statistics fold"

    @property
    def refreshes(self) -> str:
        """The plural of `refresh` ("inverses", "bases")."""
        word = self.refresh
        if word.endswith("is"):
            return word[:-2] + "es"
        return word + ("es" if word.endswith(("s", "x", "sh", "ch")) else "s")

    def part_work(self, part: int) -> str:
        """The refresh work of `part` in words: "A factor inverse", "left root"."""
        return f"{self.parts[part]} {self.refresh}"


@dataclass(frozen=True)
class TaskRules:
    """The task structure of one curvature method.

    `labels`: its names of its work; the number of its parts is that of `labels.parts`.
    `curvature`: each part is built from per-micro-batch curvature tasks of the cycle's first
    step; otherwise from the stage's whole gradient of that step (after its backwards).
    `syncs`: the parts whose inputs are all-reduced over a replicated stage, one sync op each;
    none for a method whose inputs are alike on every replica already (SOAP's statistics come from
    the reduced gradient).
    `sync_of`: (part, sync) pairs: the sync whose result the part's refresh work reads (empty when
    `syncs` is).
    `precondition`: a per-step precondition op after the stage's backwards, before the gradient
    reduction (False: the method preconditions in the optimizer step, on the reduced gradient).
    `deferred_statistics`: the method folds the final gradient of every step into its statistics
    in a per-step fold op (`OpKind.FOLD`) of the next step, anywhere in that step's bubbles; no op
    waits for it, since the runtime folds what is held before anything reads the statistics (a
    layer's share of that fold is its profile's `fold` time, which the method's timer measures;
    a precondition op of the same method takes its `precondition` time apart).
    `helpers`: a layer's share of the per-step precondition op can run on another rank (a help
    op, `OpKind.HELP`, placed by `pipefisher.planning.packing.helpers`): the method's runtime sends
    that rank the layer's input of the step and takes the result back before its optimizer step.
    `step_end_precondition`: the method's optimizer step does the precondition op's work for every
    matrix no P op did (Shampoo's products, SOAP's rotation in), so its P ops are optional: the
    packer keeps them where they shorten the mean step (`pipefisher.planning.packing.step_end`).
    `shared_when_split`: (split, part) pairs: under tensor parallelism the part's statistic of a
    layer split that way is the same on every shard of a rank (K-FAC: a column split's input
    factor, a row split's output-gradient factor), so each shard builds it from its share of the
    rows and the refresh work that reads it first sums it over the shards.
    """

    curvature: bool
    syncs: tuple[int, ...]
    sync_of: tuple[tuple[int, int], ...]
    precondition: bool
    labels: WorkLabels
    shared_when_split: tuple[tuple[str, int], ...] = ()
    deferred_statistics: bool = False
    helpers: bool = False
    step_end_precondition: bool = False

    def __post_init__(self) -> None:
        if len(self.labels.parts) > MAX_PARTS:
            raise ValueError(f"labels.parts: {self.labels.parts!r} has more than {MAX_PARTS} parts")
        if self.deferred_statistics and self.curvature:
            raise ValueError("deferred_statistics: a method with per-micro-batch curvature has no fold op")
        if self.helpers and not self.precondition:
            raise ValueError("helpers: a method without a precondition op has no per-step work to hand out")
        if self.step_end_precondition and not self.precondition:
            raise ValueError("step_end_precondition: a method without a precondition op has none to do in its step end")
        if self.curvature and not self.parts:
            raise ValueError("curvature: a method without parts has no curvature tasks")
        for split, part in self.shared_when_split:
            if split not in ("column", "row") or part not in self.parts:
                raise ValueError(
                    f"shared_when_split: ({split!r}, {part!r}) must pair 'column' or 'row' with a part of {self.parts}"
                )
        if not self.syncs:
            if self.sync_of:
                raise ValueError(f"sync_of: {self.sync_of!r} names syncs of a method without any (`syncs` is empty)")
            return
        parts = [part for part, _ in self.sync_of]
        if sorted(parts) != list(self.parts) or not {sync for _, sync in self.sync_of} <= set(self.syncs) <= set(
            self.parts
        ):
            raise ValueError(f"sync_of: {self.sync_of!r} must name one sync of `syncs` for each part of {self.parts}")

    @property
    def parts(self) -> range:
        """The indices of its parts."""
        return range(len(self.labels.parts))

    def shared_part(self, split: str | None) -> int | None:
        """The part whose statistic a layer split as `split` ("column", "row", None) shares over
        the shards of a rank; None when nothing is shared."""
        return None if split is None else dict(self.shared_when_split).get(split)

    def shared_statistics(
        self, layers: Iterable[tuple[int, str]], plan: TensorParallelPlan
    ) -> frozenset[tuple[int, str, int]]:
        """(stage, layer, part) of the (stage, layer) `layers` whose part the shards of a rank
        share when `plan` splits the model (`shared_when_split`)."""
        found = set()
        for stage, name in layers:
            split = split_of(name, plan)
            part = self.shared_part(split.value if split is not None else None)
            if part is not None:
                found.add((stage, name, part))
        return frozenset(found)

    def sync_for(self, part: int) -> int | None:
        """The sync part `part`'s refresh work reads; None for a method without syncs."""
        return dict(self.sync_of).get(part)

    @property
    def timed_fields(self) -> tuple[str, ...]:
        """The profile's time fields of a layer that the method's timer measures
        (`pipefisher.core.profile.time_key`): its parts' curvature, syncs and refresh work, the
        precondition (its per-step work, wherever it runs) and, with `deferred_statistics`, the
        fold (its U op's)."""
        work = {"curvature": self.parts if self.curvature else (), "sync": self.syncs, "refresh": self.parts}
        per_step = ("precondition", "fold") if self.deferred_statistics else ("precondition",)
        return tuple(time_key(kind, part) for kind in PART_WORK for part in work[kind]) + per_step
