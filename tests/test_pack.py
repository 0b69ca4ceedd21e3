import json
from pathlib import Path
from collections import Counter
from dataclasses import replace

import pytest

from pipefisher.core.ir import Op, OpKind, ScheduleError
from pipefisher.core.profile import LayerProfile, Profile, StageProfile
from pipefisher.methods.registry import task_rules
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.planning.plan import Plan, simulate_plan, validate_plan
from pipefisher.planning.simulate import COLLECTIVES
from pipefisher.planning.tasks import CYCLE_KINDS, build_tasks
from pipefisher.schedules import get_schedule

from builders import layered_profile, rules_of
from sweeps import cases

#: every registered schedule (with its own chunks per rank) on 2 ranks with the fewest
#: micro-batches it takes from 4 on, and edge sizes of the first schedules: one micro-batch per
#: stage, a count that is no multiple of the stages, 4 ranks
CASES = [case.values + (None,) for case in cases((2, range(4, 9)), first=True)] + [
    ("gpipe", 2, 2, None),
    ("gpipe", 4, 8, None),
    ("1f1b", 3, 5, None),
    ("1f1b", 4, 4, None),
    ("chimera", 4, 4, None),
    ("chimera", 4, 8, None),
]


def packed(name, d, n, chunks, **options):
    schedule = get_schedule(name, d, n, chunks)
    profile = layered_profile(schedule.num_stages, sync=options.pop("sync", 0.0), inverse=options.pop("inverse", 0.4))
    return schedule, profile, pack(schedule, profile, rules_of(profile), PackOptions(**options))


@pytest.mark.parametrize("strategy", ["fill", "published"])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("name, d, n, chunks", CASES)
def test_plan_is_valid_complete_and_respects_dependencies(name, d, n, chunks, split, strategy):
    schedule, profile, result = packed(name, d, n, chunks, split=split, strategy=strategy, sync=0.1)
    plan = validate_plan(result.plan)
    tasks = build_tasks(schedule, profile, rules_of(profile), split=split)
    cycle = Counter(op for op in plan.curvature_ops() if op.kind in CYCLE_KINDS)
    assert cycle == Counter(op for ops in tasks.cycle for op in ops), "every cycle task exactly once"
    for step in plan.steps:
        for rank, ops in enumerate(step):
            assert [op for op in ops if op.kind is OpKind.PRECONDITION] == sorted(tasks.per_step[rank], key=ops.index)
    assert result.refresh_steps >= result.lower_bound or result.options.strategy == "published"
    graph = plan.graph
    for index, timeline in enumerate(result.timelines):
        end = {iv.op: iv.end for ivs in timeline.ranks for iv in ivs}
        start = {iv.op: iv.start for ivs in timeline.ranks for iv in ivs}
        for ivs in timeline.ranks:
            for a, b in zip(ivs, ivs[1:]):
                assert a.end <= b.start + 1e-9, "no two ops of a rank overlap"
            for iv in ivs:
                for dep in graph.dependencies(iv.op, first_step=index == 0):
                    if dep in end:
                        delay = tasks.durations.work(dep) if dep.kind in COLLECTIVES else 0.0
                        assert end[dep] + delay <= start[iv.op] + 1e-9


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "chimera"])
def test_work_that_fits_the_bubbles_gives_k_1_within_budget(name):
    schedule = get_schedule(name, 4, 8)
    profile = layered_profile(4, curvature=0.001, inverse=0.01, precondition=0.001)
    result = pack(schedule, profile, rules_of(profile))
    assert result.refresh_steps == 1 and result.lower_bound == 1
    # The rank that ends the step can only take its last micro-batch's B curvature (and the
    # B inverses after it) after its last backward: a little unavoidable overhead.
    assert 0 < result.overhead <= 0.01


def test_work_that_fits_the_bubbles_of_ranks_that_finish_early_costs_nothing():
    schedule = get_schedule("1f1b", 4, 8)
    profile = layered_profile(4, curvature=0.001, inverse=0.01, precondition=0.001)
    # Stage 0 (the rank that ends a 1F1B step) holds only embeddings: no K-FAC layers.
    profile = Profile(stages=(StageProfile(1.0, 2.0),) + profile.stages[1:])
    result = pack(schedule, profile, rules_of(profile))
    assert result.refresh_steps == 1
    assert result.overhead == pytest.approx(0.0, abs=1e-12)
    assert result.step_time == pytest.approx(result.first_order_step_time)


@pytest.mark.parametrize("name, d, n, chunks", CASES)
def test_curvature_work_stays_out_of_the_step_end(name, d, n, chunks):
    schedule = get_schedule(name, d, n, chunks)
    base = layered_profile(schedule.num_stages, curvature=0.001, inverse=0.01, precondition=0.001)
    profile = replace(base, stages=tuple(replace(s, step_end=0.5 + s.forward * i) for i, s in enumerate(base.stages)))
    result, without = pack(schedule, profile, rules_of(profile)), pack(schedule, base, rules_of(base))
    assert result.first_order.step_time > without.first_order.step_time
    # The step end is busy time, not a bubble: packing costs no more time than without it.
    assert result.step_time - result.first_order.step_time <= without.step_time - without.first_order.step_time + 1e-9


def test_more_work_needs_more_steps_but_never_beats_the_bound():
    schedule = get_schedule("gpipe", 4, 4)
    previous = 0
    for inverse in (0.2, 1.0, 3.0):
        result = pack(
            schedule,
            layered_profile(4, inverse=inverse, stage_growth=0.0),
            rules_of(layered_profile(4, inverse=inverse, stage_growth=0.0)),
        )
        assert result.lower_bound <= result.refresh_steps
        assert result.refresh_steps >= previous
        previous = result.refresh_steps
    assert previous > 1


def test_tasks_longer_than_every_bubble_are_amortised_up_to_the_cap():
    schedule = get_schedule("1f1b", 2, 4)
    profile = layered_profile(2, layers=2, inverse=0.1, stage_growth=0.0)
    huge = LayerProfile("huge", curvature=(0.01, 0.01), refresh=(50.0, 0.01))
    profile = Profile(stages=(StageProfile(1.0, 2.0, layers=profile.stages[0].layers + (huge,)), profile.stages[1]))
    without = pack(
        schedule,
        layered_profile(2, layers=2, inverse=0.1, stage_growth=0.0),
        rules_of(layered_profile(2, layers=2, inverse=0.1, stage_growth=0.0)),
    )
    result = pack(schedule, profile, rules_of(profile))
    assert Op(OpKind.REFRESH, 0, None, 0, "huge", part=0) in result.unplaceable
    # The rest fits at the same k as without the huge task; k then grows while a step saves >= 1 %.
    assert f"k grew from {without.refresh_steps} to amortise" in result.reason
    overhead = {p.refresh_steps: p.overhead for p in result.frontier}
    k = result.refresh_steps
    assert (
        overhead[k - 1] - overhead[k]
        >= 0.01
        > overhead[k] - pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=k + 1)).overhead
    )
    capped = pack(schedule, profile, rules_of(profile), PackOptions(max_refresh_steps=4))
    assert capped.refresh_steps == 4 and "max_refresh_steps" in capped.reason


def test_pinned_refresh_interval_is_respected():
    schedule, profile, result = packed("1f1b", 4, 4, None, refresh_steps=1)
    free = pack(schedule, profile, rules_of(profile))
    assert result.refresh_steps == 1 and free.refresh_steps > 1
    assert result.step_time > free.step_time
    validate_plan(result.plan)


def test_packing_is_deterministic():
    _, _, first = packed("chimera", 4, 8, None)
    _, _, second = packed("chimera", 4, 8, None)
    assert first.plan == second.plan


def test_chimera_splits_inverses_between_replicas_and_exchanges_them():
    schedule = get_schedule("chimera", 4, 4)
    profile = layered_profile(4)
    split = build_tasks(schedule, profile, rules_of(profile), split=True)
    whole = build_tasks(schedule, profile, rules_of(profile), split=False)
    inverses = lambda tasks: [op for ops in tasks.cycle for op in ops if op.kind is OpKind.REFRESH]
    assert len(inverses(whole)) == 2 * len(inverses(split))
    assert {(op.kind, op.stage, op.layer) for op in inverses(split)} == {
        (op.kind, op.stage, op.layer) for op in inverses(whole)
    }
    loads = [sum(split.durations(op) for op in ops if op.kind is OpKind.REFRESH) for ops in split.cycle]
    unsplit = [sum(whole.durations(op) for op in ops if op.kind is OpKind.REFRESH) for ops in whole.cycle]
    assert max(loads) < 0.7 * max(unsplit)
    exchanges = [op for ops in split.cycle for op in ops if op.kind is OpKind.EXCHANGE]
    assert exchanges and not [op for ops in whole.cycle for op in ops if op.kind is OpKind.EXCHANGE]
    assert {op.kind for ops in split.cycle for op in ops} >= {OpKind.SYNC}


def test_published_rule_makes_inverses_wait_for_all_curvature_of_their_kind():
    _, _, result = packed("gpipe", 4, 4, None, strategy="published")
    for rank in range(4):
        sequence = [op for step in result.plan.steps for op in step[rank]]
        last_curv_a = max(i for i, op in enumerate(sequence) if (op.kind, op.part) == (OpKind.CURVATURE, 0))
        first_inv_a = min(i for i, op in enumerate(sequence) if (op.kind, op.part) == (OpKind.REFRESH, 0))
        assert first_inv_a > last_curv_a


def test_never_worse_than_the_published_rule_at_matched_k_and_never_dominated():
    for name, d, n, chunks in CASES:
        schedule, profile, ours = packed(name, d, n, chunks)
        _, _, published = packed(name, d, n, chunks, strategy="published")
        for k in range(1, max(ours.refresh_steps, published.refresh_steps) + 2):
            at_k = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=k))
            theirs = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=k, strategy="published"))
            assert at_k.step_time <= theirs.step_time + 1e-9, (name, d, n, k)
        dominated = published.refresh_steps <= ours.refresh_steps and published.overhead <= ours.overhead
        assert not dominated or (published.refresh_steps, published.overhead) == pytest.approx(
            (ours.refresh_steps, ours.overhead)
        )


def test_plan_json_round_trip(tmp_path):
    _, profile, result = packed("chimera", 4, 4, None)
    path = tmp_path / "plan.json"
    result.plan.save(path)
    loaded = Plan.load(path, task_rules)
    assert loaded == result.plan
    assert [t.step_time for t in simulate_plan(loaded, profile)] == [t.step_time for t in result.timelines]
    assert json.loads(path.read_text())["schema"] == "pipefisher.plan/v2"


def test_a_version_1_plan_file_loads_checks_and_saves_as_v2(tmp_path):
    """The plan written at 5fbc261 (ops ``0CA0:embed``, ``1IB:blocks.1.output``, no parts)."""
    written = Path(__file__).parent / "fixtures" / "written_at_5fbc261" / "plan.json"
    assert json.loads(written.read_text())["schema"] == "pipefisher.plan/v1"
    plan = validate_plan(Plan.load(written, task_rules))
    assert plan.method == "kfac" and plan.rules == task_rules("kfac")
    tokens = {op.token for op in plan.curvature_ops()}
    assert {"C0", "C1", "R0", "R1", "P"} <= tokens
    plan.save(tmp_path / "plan.json")
    assert "CA" not in (tmp_path / "plan.json").read_text()
    assert Plan.load(tmp_path / "plan.json", task_rules) == plan


def test_validate_plan_rejects_an_inverse_before_its_curvature():
    _, _, result = packed("1f1b", 2, 2, None, refresh_steps=1)
    steps = [list(map(list, step)) for step in result.plan.steps]
    ops = steps[0][0]
    inverse = next(op for op in ops if (op.kind, op.part) == (OpKind.REFRESH, 0))
    ops.remove(inverse)
    ops.insert(0, inverse)
    broken = replace(result.plan, steps=tuple(tuple(tuple(r) for r in step) for step in steps))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_plan(broken)


def test_validate_plan_rejects_collectives_in_different_orders():
    _, _, result = packed("chimera", 2, 2, None, refresh_steps=1)
    steps = [list(map(list, step)) for step in result.plan.steps]
    rank0 = steps[0][0]
    syncs = [i for i, op in enumerate(rank0) if op.kind is OpKind.SYNC]
    i, j = syncs[0], syncs[-1]
    rank0[i], rank0[j] = rank0[j], rank0[i]
    broken = replace(result.plan, steps=tuple(tuple(tuple(r) for r in step) for step in steps))
    with pytest.raises(ScheduleError):
        validate_plan(broken)


def test_validate_plan_rejects_a_task_run_twice():
    _, _, result = packed("gpipe", 2, 2, None, refresh_steps=2)
    steps = [list(map(list, step)) for step in result.plan.steps]
    extra = next(op for op in steps[0][1] if (op.kind, op.part) == (OpKind.CURVATURE, 0))
    steps[1][1].append(extra)
    broken = replace(result.plan, steps=tuple(tuple(tuple(r) for r in step) for step in steps))
    with pytest.raises(ScheduleError, match="more than once"):
        validate_plan(broken)


def test_report_fields():
    _, _, result = packed("1f1b", 4, 8, None)
    data = result.to_dict()
    for key in ("refresh_steps", "first_order_step_time", "step_time", "bubble_utilization", "devices", "lower_bound"):
        assert key in data
    assert 0 <= data["bubble_utilization"] <= 1
    assert (
        data["refresh_steps"] == max(d["refresh_steps"] for d in data["devices"])
        or data["refresh_steps"] >= data["lower_bound"]
    )
    assert [d["rank"] for d in data["devices"]] == [0, 1, 2, 3]


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="margin"):
        PackOptions(margin=1.5)
    with pytest.raises(ValueError, match="strategy"):
        PackOptions(strategy="magic")


@pytest.mark.parametrize("data_parallel", [1, 2])
@pytest.mark.parametrize("name, d, n, chunks", CASES)
def test_predicted_cycle_time_equals_a_full_simulation_of_the_plan(name, d, n, chunks, data_parallel):
    """The packer simulates only the steps with leftovers or collectives: the others must take
    exactly as long as a step with preconditioning only."""
    from pipefisher.planning.plan import cycle_time

    schedule = get_schedule(name, d, n, chunks)
    for inverse in (0.1, 0.4, 2.0):
        profile = layered_profile(schedule.num_stages, inverse=inverse, sync=0.05)
        for k in (None, 1, 2, 5):
            result = pack(
                schedule, profile, rules_of(profile), PackOptions(refresh_steps=k, data_parallel=data_parallel)
            )
            simulated = cycle_time(simulate_plan(result.plan, profile))
            assert result.cycle_time == pytest.approx(simulated, rel=1e-9, abs=1e-9), (inverse, k)


@pytest.mark.parametrize("name, d, n, chunks", CASES)
def test_never_predicted_slower_than_the_after_step_placement(name, d, n, chunks):
    from pipefisher.planning.packing.pack import after_step_plan
    from pipefisher.planning.plan import cycle_time

    schedule = get_schedule(name, d, n, chunks)
    for inverse in (0.4, 5.0):
        profile = layered_profile(schedule.num_stages, inverse=inverse, sync=0.05)
        result = pack(schedule, profile, rules_of(profile))
        after = cycle_time(
            simulate_plan(after_step_plan(schedule, profile, rules_of(profile), result.refresh_steps), profile)
        )
        assert result.cycle_time <= after + 1e-9


def test_packing_sizes_kfac_tasks_at_the_percentile_and_keeps_bubbles_nominal():
    schedule = get_schedule("1f1b", 2, 4)
    base = layered_profile(2, inverse=0.1, stage_growth=0.0)
    slow_tail = tuple(
        replace(
            s,
            samples={"forward": (1.0, 1.0, 1.0, 1.0, 3.0)},
            layers=tuple(replace(layer, samples={"refresh.0": (0.1, 0.1, 0.1, 0.1, 2.5)}) for layer in s.layers),
        )
        for s in base.stages
    )
    noisy = replace(base, stages=slow_tail)
    median = pack(schedule, noisy, rules_of(noisy), PackOptions(percentile=50))
    high = pack(schedule, noisy, rules_of(noisy), PackOptions(percentile=100))
    nominal = pack(schedule, base, rules_of(base), PackOptions(percentile=None))
    assert median.first_order_step_time == high.first_order_step_time == pytest.approx(nominal.first_order_step_time)
    assert (median.refresh_steps, median.overhead) == (nominal.refresh_steps, pytest.approx(nominal.overhead))
    assert (high.refresh_steps, high.step_time) > (median.refresh_steps, median.step_time)
    assert high.to_dict()["percentile"] == 100


@pytest.mark.parametrize("name, d, n, chunks", CASES)
def test_no_plan_below_the_lower_bound_is_free(name, d, n, chunks):
    schedule = get_schedule(name, d, n, chunks)
    for inverse in (0.4, 1.5):
        profile = layered_profile(schedule.num_stages, inverse=inverse)
        result = pack(schedule, profile, rules_of(profile))
        for k in range(1, result.lower_bound):
            assert pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=k)).overhead > 1e-9, (
                inverse,
                k,
            )


def test_the_bound_counts_tasks_that_only_the_largest_bubble_holds():
    """Eight inverses that fit only a device's longest bubble, one at a time: k >= 8 whatever
    the total bubble time."""
    schedule = get_schedule("gpipe", 2, 4)
    first = pack(
        schedule,
        layered_profile(2, layers=1, curvature=0.001, inverse=0.0, precondition=0.0),
        rules_of(layered_profile(2, layers=1, curvature=0.001, inverse=0.0, precondition=0.0)),
    )
    longest = max(b.duration for b in first.first_order.bubbles(0))
    size = 0.6 * longest
    layers = tuple(LayerProfile(f"big{i}", curvature=(0.001, 0.001), refresh=(size,)) for i in range(8))
    profile = Profile(stages=(StageProfile(1.0, 2.0, layers=layers), StageProfile(1.0, 2.0)))
    result = pack(schedule, profile, rules_of(profile))
    assert result.lower_bound >= 8 and result.refresh_steps >= result.lower_bound


@pytest.mark.parametrize("name, d, n, chunks", [("gpipe", 4, 8, None), ("chimera", 4, 4, None), ("1f1b", 3, 5, None)])
def test_every_candidate_is_evaluated_exactly(name, d, n, chunks):
    """Fill (tail, spread), the published rule and after-step, at several k: the cheap
    evaluation equals a full simulation of each plan."""
    from pipefisher.planning.packing.pack import _Packing
    from pipefisher.planning.plan import cycle_time
    from pipefisher.planning.simulate import simulate

    schedule = get_schedule(name, d, n, chunks)
    profile = layered_profile(schedule.num_stages, inverse=1.5, sync=0.05, precondition=0.3)
    tasks = build_tasks(schedule, profile, rules_of(profile))
    packing = _Packing(tasks, simulate(schedule, profile), PackOptions())
    sources = set()
    for k in (1, 2, 4):
        for candidate in packing.candidates(k):
            sources.add(candidate.source.split(",")[0])
            assert candidate.cycle_time == pytest.approx(
                cycle_time(simulate_plan(candidate.plan, profile)), rel=1e-9
            ), (k, candidate.source)
    assert {"fill", "published rule", "after-step"} <= sources
