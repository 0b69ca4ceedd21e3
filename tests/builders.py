"""The one tiny model, the one profile builder and the BERT-Large planning contexts of the tests
(pytest puts this folder on sys.path: `from builders import tiny_model, layered_profile`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pipefisher.config import load_config
from pipefisher.core.profile import LayerProfile, Profile, StageProfile
from pipefisher.methods.registry import method_of_profile
from pipefisher.planning.planner.candidates import Layout, layout_of_run
from pipefisher.planning.planner.flop_times import FlopTimes
from pipefisher.planning.planner.hardware import hardware_of
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.planning.planner.predict import PlanContext
from pipefisher.planning.planner.sources import ReferenceTimes
from pipefisher.planning.vocabulary import TaskRules
from pipefisher.testing.harness import TINY_MODEL, tiny_model  # noqa: F401  (the public harness's tiny model)


ROOT = Path(__file__).resolve().parents[1]


def bert_large_context(hardware: str | None = None) -> PlanContext:
    """K-FAC's planning context of the BERT-Large run file (`schedules/bert-large-chimera-8x8.yaml`)
    on the paper's P100 block times, on `hardware` (a preset name) where given."""
    config = load_config(ROOT / "schedules" / "bert-large-chimera-8x8.yaml")
    sizes = model_sizes(config)
    found = hardware_of(hardware) if hardware else None
    source = ReferenceTimes.open(ROOT / "profiles" / "reference" / "bert-large_time_memory_p100.csv", sizes)
    return PlanContext(sizes, replace(source, hardware=found), config.kfac.first_order, config.kfac, hardware=found)


def flop_context(method: str = "soap", **section: object) -> tuple[PlanContext, Layout]:
    """`method`'s planning context of the BERT-Large run file on 1F1B, its section set to
    `section`, on the H100's flop model (fp32), and the run file's layout."""
    config = load_config(ROOT / "schedules" / "bert-large-chimera-8x8.yaml").with_overrides(
        pipeline={"schedule": "1f1b"}, **{method: section}
    )
    sizes, hardware = model_sizes(config), hardware_of("h100")
    source = FlopTimes.check(sizes, hardware, "fp32", method, config.section(method))
    layout = layout_of_run(config.pipeline, config.data.micro_batch_size, method, 0, 0)
    return PlanContext(sizes, source, "adamw", config.section(method), hardware=hardware), layout


def rules_of(profile: Profile) -> TaskRules:
    """The task rules of the method whose times `profile` holds (K-FAC's where it names none)."""
    return method_of_profile(profile).rules


def layered_profile(
    num_stages: int,
    layers: int = 3,
    *,
    forward: float = 1.0,
    backward: float = 2.0,
    p2p: float = 0.0,
    weight: float = 0.0,
    grad_reduce: float = 0.0,
    curvature: float = 0.05,
    inverse: float = 0.4,
    inverse_b: float | None = None,
    precondition: float = 0.02,
    fold: float = 0.0,
    sync: float = 0.0,
    sync_b: float | None = None,
    capture_a_bytes: int = 0,
    capture_b_bytes: int = 0,
    spread: bool = True,
    stage_growth: float = 0.3,
    names: str | Sequence[Sequence[str]] = "l{stage}.{i}",
    method: str = "kfac",
    time_unit: str = "ms",
    device: str = "",
) -> Profile:
    """A made-up profile: `num_stages` stages of `forward` and `backward` (of which `weight` the
    weight gradient), `p2p` and `grad_reduce`, with `layers` curvature layers each, named by the
    format `names` (`stage`, `i`) or given per stage as lists (which then set the count).

    spread (default): tasks differ in length by layer and stage: layer i of L on stage s has
    curvature c(i+1)g (A) and c(L-i)g (B) and inverses v(i+1)g (A) and v(L-i)g/2 (B), with
    c = `curvature`, v = `inverse`, g = 1 + `stage_growth` s. spread=False: every layer alike,
    curvature c for both factors, inverses v (A) and `inverse_b` (B, default v). Every layer
    takes `precondition` and `fold`, syncs `sync` (A) and `sync_b` (B, default `sync`) and captures the
    bytes given per micro-batch. A and B are parts 0 and 1."""
    assert inverse_b is None or not spread, "inverse_b is for spread=False (spread sets B's inverse from A's)"
    sync_b = sync if sync_b is None else sync_b
    stages = []
    for stage in range(num_stages):
        stage_names = (
            [names.format(stage=stage, i=i) for i in range(layers)] if isinstance(names, str) else list(names[stage])
        )
        count = len(stage_names)
        if spread:
            scale = 1.0 + stage_growth * stage
            times = [
                (
                    curvature * (i + 1) * scale,
                    curvature * (count - i) * scale,
                    inverse * (i + 1) * scale,
                    inverse * (count - i) / 2 * scale,
                )
                for i in range(count)
            ]
        else:
            times = [(curvature, curvature, inverse, inverse if inverse_b is None else inverse_b)] * count
        stage_layers = tuple(
            LayerProfile(
                name,
                curvature=(curvature_a, curvature_b),
                sync=(sync, sync_b),
                refresh=(inverse_a, inverse_b_),
                precondition=precondition,
                fold=fold,
                capture_bytes=(capture_a_bytes, capture_b_bytes),
            )
            for name, (curvature_a, curvature_b, inverse_a, inverse_b_) in zip(stage_names, times)
        )
        stages.append(
            StageProfile(
                forward=forward, backward=backward, p2p=p2p, grad_reduce=grad_reduce, layers=stage_layers, weight=weight
            )
        )
    return Profile(stages=tuple(stages), time_unit=time_unit, device=device, method=method)
