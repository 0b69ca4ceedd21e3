"""The run-file keys every curvature method's section has: how its refresh work is placed. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pipefisher.core.settings import STEP_CEILING, setting
from pipefisher.core.names import FirstOrder
from pipefisher.planning.comm.actions import ZERO_REDUCTIONS, workers_problem

#: the float dtypes a method may keep its statistics in (the name of a torch dtype)
StatisticsDtype = Literal["float64", "float32"]


@dataclass(frozen=True)
class RefreshConfig:
    """How a curvature method's refresh work is placed: the keys every method's section shares
    (see `pipefisher.planning.packing.pack` for the packer's rule). Re-profiling: when the measured
    cycle time differs from the prediction by more than `reprofile_threshold` for
    `reprofile_patience` cycles in a row, the run measures again and re-packs (a steady gap right
    after a fresh measurement counts as the simulator's error, not as drift)."""

    lr: float = setting(
        0.0, "learning rate of the step of the parameters this method preconditions (0 = optimizer.lr)", low=0
    )
    momentum: float = setting(
        0.0, "momentum of that step when it is SGD (0 = optimizer.momentum)", low=0, high=1, high_open=True
    )
    first_order: FirstOrder = setting(
        "adamw",
        "rule of the parameters this method does not precondition (embeddings, tied copies, norms, biases it leaves): "
        "adamw or lamb at optimizer.lr (the rate of both when lr is 0) with optimizer.betas, eps, weight_decay; "
        "sgd: the method's own SGD step at this section's lr and momentum, as before this key",
    )
    refresh_steps: int = setting(
        0,
        "refresh interval k: new refresh results every k steps",
        low=0,
        note="0 lets the packer choose",
        ceiling=STEP_CEILING,
    )
    placement: Literal["packed", "after-step"] = setting(
        "packed", "packed: the refresh work in the bubbles; after-step: in one block after the first step of each cycle"
    )
    margin: float = setting(0.0, "share of each bubble kept free", low=0, high=1, high_open=True)
    percentile: float = setting(
        90.0,
        "pack with this percentile of the profile's measured samples",
        low=0,
        high=100,
        low_open=True,
        note="50 = the median",
    )
    max_overhead: float = setting(0.01, "budget of added step time, a share of the first-order step", low=0)
    max_refresh_steps: int = setting(
        0, "cap on the refresh interval the packer may choose", low=0, note="0 = no cap", ceiling=STEP_CEILING
    )
    max_capture_mb: float = setting(
        0.0, "cap on captures held per device, MiB (packed plans)", low=0, note="0 = no cap"
    )
    split: bool = setting(True, "spread a stage's refresh work over its pipes' replicas and exchange the results")
    helpers: bool = setting(
        False,
        "hand layers of per-step work that has no bubble (1F1B's first stage) to other ranks where the packer "
        "predicts a shorter step, and keep them while the run's own op times agree (methods whose rules allow "
        "it, TaskRules.helpers; one pipeline, one process per rank)",
    )
    profile: str = setting("", 'a pipefisher.profile/v2 file of this run ("" = measure one before training)')
    plan: str = setting(
        "", 'a pipefisher.plan/v2 file (`pipefisher pack -o`) to run as it is instead of packing ("" = pack)'
    )
    reprofile_threshold: float = setting(
        0.25, "re-profile when the cycle time drifts from the prediction by this share", low=0, low_open=True
    )
    reprofile_patience: int = setting(
        3, "cycles in a row the drift must last", low=0, low_open=True, ceiling=STEP_CEILING
    )

    def check(self, name: str, config: Any) -> None:
        """Rules between this section's keys and the rest of the run (`config`, a `RunConfig`;
        each key's own range is declared at its field): ConfigError naming `name`.key."""

    def captures_per_sequence(self) -> bool:
        """Whether its captures hold one row per sequence (means over its positions) instead of
        one per token (the planner's capture bytes)."""
        return False

    def gradient_workers(self, replicas: int, sharded: bool = False) -> int:
        """How many of a stage's `replicas` keep each layer's refresh results and precondition its
        reduced gradient (KAISA's gradient workers); every replica unless the method says fewer.
        `sharded`: the run shards parameters and gradients (optimizer.zero 2/3), where a method
        that gathers whole gradients on every replica asks for all of them."""
        return replicas

    def workers_per_layer(self, replicas: int, zero: int) -> int | None:
        """Gradient workers per layer of a stage of `replicas` copies under optimizer.zero `zero`
        (`gradient_workers`); None where every replica is one."""
        workers = self.gradient_workers(replicas, sharded=zero >= 2)
        return workers if workers < replicas else None

    def precondition_op(self, replicas: int, zero: int) -> bool:
        """Whether a stage of `replicas` copies under optimizer.zero `zero` has the method's
        per-step P op (where its rules have one): wherever every replica is a gradient worker
        (`workers_per_layer`); a method may ask for it only where its section says so."""
        return self.workers_per_layer(replicas, zero) is None

    def layout_problem(self, name: str, zero: int, replicas: int) -> str:
        """Why a layout of stages of `replicas` copies with optimizer.zero `zero` cannot run this
        method, as section `name`, with the fix; "" when it can. The run's check and the planner's
        candidates both ask: gradient workers that divide the replicas (`gradient_workers`) and
        that the ZeRO stage's reduction leaves every replica's whole gradient (`workers_problem`);
        ZeRO-1 where `zero1_problem` allows it; ZeRO-2/3 (FSDP2's shards) without LAMB for the
        parameters the method leaves to its first-order rule."""
        try:
            workers = self.workers_per_layer(replicas, zero)
        except ValueError as exc:
            return f"{name}.grad_worker_fraction: {exc}"
        if zero == 1 and (problem := self.zero1_problem(name, replicas)):
            return problem
        if workers is not None and (problem := workers_problem(ZERO_REDUCTIONS[zero])):
            return f"{name}.grad_worker_fraction: {problem}; use {name}.grad_worker_fraction 1 or optimizer.zero 0"
        if zero >= 2 and self.first_order == "lamb":
            return (
                f"{name}.first_order: lamb's trust ratio needs whole-parameter norms, which optimizer.zero {zero}'s "
                f"FSDP2 shards cut; use {name}.first_order adamw or sgd, or optimizer.zero 0"
            )
        return ""

    def zero1_problem(self, name: str, replicas: int) -> str:
        """Why ZeRO-1 (each replica of a stage steps only the parameters it owns) cannot run this
        method, asked before its gradient workers (`layout_problem`); "" when it can."""
        return ""
