"""A run file's own layout as the planner sees it, so that `pipefisher run` packs the plan that
`pipefisher plan RUN --profile P` predicts for that layout (`plan_layout`). Pure Python: no torch.

The run's layout is `layout_of_run` of its pipeline, micro-batch size, method, ZeRO stage and
PowerSGD rank (recomputation "none": a profile measured under recomputation holds its cost
already); the context is `pipefisher plan`'s for that run file and profile: the model's sizes,
the profile as the only measured time source, the method's section, momentum, precision and the
bandwidth the profile's p2p times show (`source_bandwidth_gbps`, the plan command's default).
"""

from __future__ import annotations

from pipefisher.config import RunConfig
from pipefisher.core.ir import Schedule
from pipefisher.core.profile import Profile
from pipefisher.methods.registry import method_of
from pipefisher.planning.packing.pack import PackOptions, PackResult
from pipefisher.planning.packing.step_end import pack_choosing_p_ops
from pipefisher.planning.planner.candidates import Layout, layout_of_run
from pipefisher.planning.planner.model_sizes import PlanError, model_sizes
from pipefisher.planning.planner.predict import PlanContext, plan_layout, source_bandwidth_gbps
from pipefisher.planning.planner.sources import MeasuredTimes


def run_layout(config: RunConfig, profile: Profile, name: str = "the run's profile") -> tuple[Layout, PlanContext]:
    """The run's layout (its curvature method, `method_of`) and the planning context of `config`
    with `profile` (`name`: where it came from); PlanError where the planner cannot describe the
    run: a model kind without sizes, a profile of another method, without its micro-batch size or
    not covering the model's blocks."""
    method = method_of(config).name
    section = config.section(method)
    sizes = model_sizes(config)
    source = MeasuredTimes.check([(name, profile)], sizes, method)
    context = PlanContext(
        sizes,
        source,
        section.first_order,
        section,
        config.optimizer_settings.momentum,
        config.run.precision,
        source_bandwidth_gbps(source, sizes, config.run.precision),
    )
    layout = layout_of_run(
        config.pipeline, config.data.micro_batch_size, method, config.optimizer.zero, config.comm.powersgd_rank
    )
    if profile.micro_batch_size != layout.micro_batch_size:
        raise PlanError(
            f"micro_batch_size: the profile was measured at {profile.micro_batch_size}, the run has "
            f"{layout.micro_batch_size}"
        )
    return layout, context


def run_packing(
    config: RunConfig, schedule: Schedule, profile: Profile, options: PackOptions
) -> tuple[PackResult, Profile]:
    """The run's packing and the profile its times come from: `plan_layout` of the run's layout
    (`run_layout`; its gradient workers as the run has them, `PlanContext.workers_per_layer`); where the planner
    cannot describe the run (PlanError), `profile` packed as it is with the run's `options`
    (`schedule`: the run's)."""
    try:
        layout, context = run_layout(config, profile)
    except PlanError:
        result = pack_choosing_p_ops(schedule, profile, method_of(config).rules, options)
        return result, result.profile
    return plan_layout(layout, context, schedule=schedule)
