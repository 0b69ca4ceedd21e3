"""Help ops (`OpKind.HELP`: a layer's per-step work of another rank's stage) in planning: the plan's
rules for them, their times in the simulator (the link both ways, the owner's end of step waiting
for the results), the packer's placement, the communication it implies under NCCL's rule, and the
profile's sizes that cost the link."""

from dataclasses import replace

import pytest

from builders import layered_profile
from pipefisher.core.ir import Op, OpKind, ScheduleError
from pipefisher.core.profile import Profile, profile_from_dict
from pipefisher.core.topology import Topology
from pipefisher.methods.registry import task_rules
from pipefisher.planning.comm.actions import ActionKind, CollectiveKind
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.packing.exposed import MeasuredDurations, helpers_gain, timing_key
from pipefisher.planning.packing.helpers import helped_layers, place_helpers, with_help, without_help
from pipefisher.planning.packing.pack import PackOptions, after_step_plan, pack
from pipefisher.planning.plan import cycle_time, simulate_plan, validate_plan
from pipefisher.planning.simulate import OpDurations
from pipefisher.schedules import get_schedule

#: a layer's weight: 1,000 bytes; the link: 1,000 bytes per ms (p2p 0.5 ms for 500 bytes)
WEIGHT, LINK = 1000, 1000.0


def linked_profile(link: bool = True, method: str = "muon") -> Profile:
    """Two stages of four layers each (Muon's matrices unless `method` is named), 2 ms of per-step
    work per layer on stage 0 and 0.25 ms on stage 1 (whose P op then ends well before stage 0's
    last backward in 1F1B); the link's speed known (`link`) or not."""
    profile = layered_profile(2, 4, spread=False, p2p=0.5, method=method)
    stages = tuple(
        replace(
            stage,
            p2p_bytes=500 if link and index == 0 else 0,
            layers=tuple(
                replace(layer, weight_bytes=WEIGHT, precondition=2.0 if index == 0 else 0.25) for layer in stage.layers
            ),
        )
        for index, stage in enumerate(profile.stages)
    )
    return replace(profile, stages=stages)


def plain_plan(schedule="1f1b", profile=None):
    return after_step_plan(get_schedule(schedule, 2, 4), profile or linked_profile(), task_rules("muon"), 1)


def help_op(layer="l0.0", stage=0):
    return Op(OpKind.HELP, stage, None, 0, layer)


@pytest.fixture
def alone():
    """A registered method whose rules allow no help ops (every built-in one does): Muon's
    declaration under another name, with `TaskRules.helpers` off."""
    from pipefisher.methods import registry

    muon = registry.method("muon")
    method = registry.register(
        replace(muon, name="muon_alone", label="Muon alone", rules=replace(muon.rules, helpers=False))
    )
    yield method
    registry.unregister(method.name)


def test_help_op_round_trips_names_its_layer_and_draws_as_preconditioning():
    from pipefisher.viz.layout import category

    op = help_op()
    assert str(op) == "0H:l0.0" and Op.parse(str(op)) == op and op.kind.has_layer
    assert category(op) == "precondition"


def test_a_plan_refuses_help_ops_off_their_rules(alone):
    plan = plain_plan()
    with pytest.raises(ScheduleError, match=r"0H:l0.0 is on rank 0, the rank of its stage"):
        validate_plan(with_help(plan, help_op(), 0))
    twice = with_help(with_help(plan, help_op(), 1), help_op(), 1)
    with pytest.raises(ScheduleError, match=r"0H:l0.0 runs 2 times"):
        validate_plan(twice)
    solo = after_step_plan(get_schedule("1f1b", 2, 4), linked_profile(method=alone.name), alone.rules, 1)
    with pytest.raises(ScheduleError, match=r"method muon_alone has no HELP ops"):
        validate_plan(with_help(solo, help_op(), 1))
    assert validate_plan(with_help(plan, help_op(), 1)).helped == frozenset({(0, "l0.0")})


def test_a_help_takes_its_layer_off_the_precondition_op_and_the_link_both_ways():
    """1F1B on 2 stages: stage 0's P (4 x 2 ms) ends the step; a help on rank 1 takes 2 ms of it,
    starts 1 ms (1,000 bytes at 1,000 per ms) after stage 0's last backward, and the result's way
    back (1 ms) ends before stage 0's P, so rank 0's end of step starts 2 ms earlier."""
    profile = linked_profile()
    plan = plain_plan(profile=profile)
    before = simulate_plan(plan, profile)[0]
    after = simulate_plan(with_help(plan, help_op(), 1), profile)[0]
    p_before = next(iv for iv in before.ranks[0] if iv.op.kind is OpKind.PRECONDITION)
    p_after = next(iv for iv in after.ranks[0] if iv.op.kind is OpKind.PRECONDITION)
    helped = next(iv for iv in after.ranks[1] if iv.op.kind is OpKind.HELP)
    assert p_before.duration == pytest.approx(8.0) and p_after.duration == pytest.approx(6.0)
    assert helped.duration == pytest.approx(2.0)
    assert helped.start >= p_after.start + 1.0 - 1e-9
    assert after.tail_start(0) == pytest.approx(max(p_after.end, helped.end + 1.0))
    assert after.step_time == pytest.approx(before.step_time - 2.0)
    assert after.tail(1) == before.tail(1), "a help holds no stage: its rank pays no step end for it"


def test_the_owner_waits_for_a_slow_result():
    """A link 100 times slower: the result comes back 100 ms after the help, and the step waits."""
    profile = linked_profile()
    slow = replace(profile, stages=(replace(profile.stages[0], p2p=50.0), profile.stages[1]))
    timeline = simulate_plan(with_help(plain_plan(profile=slow), help_op(), 1), slow)[0]
    helped = next(iv for iv in timeline.ranks[1] if iv.op.kind is OpKind.HELP)
    assert timeline.tail_start(0) == pytest.approx(helped.end + 100.0)


def test_the_packer_hands_out_layers_while_the_step_shortens():
    profile = linked_profile()
    schedule = get_schedule("1f1b", 2, 4)
    plain = pack(schedule, profile, task_rules("muon"), PackOptions(percentile=None))
    helped = pack(schedule, profile, task_rules("muon"), PackOptions(percentile=None, helpers=True))
    layers = helped_layers(helped.plan)[(0, 0)]
    assert 0 < len(layers) < 4 and all(rank == 1 for _, rank in layers)
    assert helped.cycle_time < plain.cycle_time - 1.0
    assert helped.cycle_time == pytest.approx(cycle_time(simulate_plan(helped.plan, profile)))
    assert "helpers:" in helped.reason
    validate_plan(helped.plan)


def test_stages_ending_the_step_together_are_helped_both():
    """1F1B on 3 stages: stage 1's P (4 x 1.625 ms) starts 2.5 ms before stage 0's (4 x 1 ms), so
    both end the step at 33 ms; taking one layer off either alone leaves the cycle as it is, so
    the placement orders ranks' ends latest first (`finish_order`) and helps both from rank 2,
    stage 1's help first (its input comes first)."""
    profile = layered_profile(3, 4, spread=False, p2p=0.5, method="muon")
    times = (1.0, 1.625, 0.1)
    stages = tuple(
        replace(
            stage,
            p2p_bytes=500 if index < 2 else 0,
            layers=tuple(replace(layer, weight_bytes=100, precondition=times[index]) for layer in stage.layers),
        )
        for index, stage in enumerate(profile.stages)
    )
    profile = replace(profile, stages=stages)
    plan = after_step_plan(get_schedule("1f1b", 3, 6), profile, task_rules("muon"), 1)
    before = simulate_plan(plan, profile)[0]
    assert before.tail_start(0) == pytest.approx(before.tail_start(1)) == pytest.approx(before.step_time)
    helped, cycle = place_helpers(plan, OpDurations(profile))
    placed = helped_layers(helped)
    assert set(placed) == {(0, 0), (0, 1)} and {rank for layers in placed.values() for _, rank in layers} == {2}
    assert cycle < before.step_time - 1.0
    assert cycle == pytest.approx(cycle_time(simulate_plan(helped, profile)))
    helps = [op.stage for op in helped.steps[0][2] if op.kind is OpKind.HELP]
    assert helps == sorted(helps, reverse=True), "stage 1's help ops come before stage 0's"


def test_helpers_let_the_packer_lengthen_the_cycle_that_frees_the_helpers():
    """K-FAC with slow inverses: the packer's k (8) fills rank 1's end of step with refresh work,
    where the help op would go; helped, the best plans at 2k and 4k free it, and the smallest k
    within `max_overhead` of the longest's mean step is kept. A pinned k, or a cap on k, holds."""
    profile = linked_profile(method="kfac")
    profile = replace(
        profile,
        stages=tuple(
            replace(stage, layers=tuple(replace(layer, refresh=(2.0, 2.0)) for layer in stage.layers))
            for stage in profile.stages
        ),
    )
    schedule, rules = get_schedule("1f1b", 2, 4), task_rules("kfac")
    plain = pack(schedule, profile, rules, PackOptions())
    helped = pack(schedule, profile, rules, PackOptions(helpers=True))
    assert helped.refresh_steps in (2 * plain.refresh_steps, 4 * plain.refresh_steps)
    assert helped.cycle_time / helped.refresh_steps < plain.cycle_time / plain.refresh_steps
    assert f"k = {helped.refresh_steps}" in helped.reason.split("helpers:")[1]
    pinned = pack(schedule, profile, rules, PackOptions(helpers=True, refresh_steps=plain.refresh_steps))
    assert pinned.refresh_steps == plain.refresh_steps and helped_layers(pinned.plan)
    capped = pack(schedule, profile, rules, PackOptions(helpers=True, max_refresh_steps=plain.refresh_steps + 1))
    assert capped.refresh_steps == plain.refresh_steps


def test_no_helpers_without_a_measured_link_or_a_method_that_allows_them(alone):
    unknown = linked_profile(link=False)
    plan = plain_plan(profile=unknown)
    assert place_helpers(plan, OpDurations(unknown))[0] is plan
    solo = pack(get_schedule("1f1b", 2, 4), linked_profile(method=alone.name), alone.rules, PackOptions(helpers=True))
    assert not helped_layers(solo.plan)
    kfac = linked_profile(method="kfac")
    assert helped_layers(pack(get_schedule("1f1b", 2, 4), kfac, task_rules("kfac"), PackOptions(helpers=True)).plan)
    replicated = pack(
        get_schedule("1f1b", 2, 4),
        linked_profile(method="kfac"),
        task_rules("kfac"),
        PackOptions(helpers=True, data_parallel=2),
    )
    assert not helped_layers(replicated.plan), "no help collectives pair a stage's replicas"
    chimera = pack(
        get_schedule("chimera", 2, 4), linked_profile(method="kfac"), task_rules("kfac"), PackOptions(helpers=True)
    )
    assert not helped_layers(chimera.plan)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_helped_plans_replay_under_nccls_rule(schedule):
    """The stage's rank launches help_in and help_out after its last backward (or weight
    gradient), the helper waits for help_in before its first help op and launches help_out after
    its last, both wait for both before the world reduction; the replay accepts the order."""
    profile = linked_profile()
    plan = pack(get_schedule(schedule, 2, 4), profile, task_rules("muon"), PackOptions(helpers=True)).plan
    helped = helped_layers(plan)
    assert helped, "the packer placed no help op"
    [(pipe, stage)] = helped
    owner, helper = plan.schedule.placement[(pipe, stage)], helped[(pipe, stage)][0][1]
    comm = plan_actions(Topology(plan.schedule), plan)
    assert comm.members[("help", owner, helper)] == (owner, helper)
    texts = [[str(action) for action in comm.steps[0][rank]] for rank in (owner, helper)]
    helps = [i for i, text in enumerate(texts[1]) if text.startswith(f"{stage}H:")]
    assert texts[1][helps[0] - 2 : helps[0]] == [f"+help_in:{stage}", f"w:help_in:{stage}"]
    assert texts[1][helps[-1] + 1] == f"+help_out:{stage}"
    for rank_texts in texts:  # both wait for both before the world reduction, and not after it
        step = rank_texts.index("+step")
        for name in (f"w:help_in:{stage}", f"w:help_out:{stage}"):
            assert name in rank_texts[:step] and name not in rank_texts[step:]
    launches = [a for a in comm.steps[0][owner] if a.kind is ActionKind.LAUNCH]
    assert [a.collective.kind for a in launches if a.collective.group[0] == "help"] == [
        CollectiveKind.HELP_IN,
        CollectiveKind.HELP_OUT,
    ]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_kfac_helpers_get_the_inverses_in_each_cycles_first_step(schedule):
    """K-FAC's help op applies its layer's inverses: in the cycle's first step both ranks launch
    ``help_state`` before their first op, the helper waits for it (after help_in) before its
    first help op, the stage's rank before the world reduction; later steps carry none. The
    replay accepts the order."""
    plan = pack(
        get_schedule(schedule, 2, 4), linked_profile(method="kfac"), task_rules("kfac"), PackOptions(helpers=True)
    ).plan
    helped = helped_layers(plan)
    assert helped and len(plan.steps) > 1, "a cycle of several steps with help ops"
    [(pipe, stage)] = helped
    owner, helper = plan.schedule.placement[(pipe, stage)], helped[(pipe, stage)][0][1]
    comm = replay(plan_actions(Topology(plan.schedule), plan))
    first = [[str(action) for action in comm.steps[0][rank]] for rank in (owner, helper)]
    for texts in first:
        first_op = next(i for i, text in enumerate(texts) if text[0].isdigit())  # an op's run, e.g. 0F0
        assert texts.index(f"+help_state:{stage}") == first_op - 1
        assert texts.index(f"w:help_state:{stage}") < texts.index("+step")
    helps = [i for i, text in enumerate(first[1]) if text.startswith(f"{stage}H:")]
    assert first[1][helps[0] - 1] == f"w:help_state:{stage}"
    later = [str(action) for step in comm.steps[1:] for rank in (owner, helper) for action in step[rank]]
    assert not [text for text in later if "help_state" in text]


def test_the_gain_of_help_ops_on_measured_times():
    """`helpers_gain`: the plan's mean step without its help ops (their layers' help time back
    on the P op) less with them. On the profile's own times the help above pays 2 ms; where the
    run measured the P op and the help op at 0.3 and 0.1 ms, the link's 1 ms each way costs more
    than the help takes off, and the gain is negative."""
    profile = linked_profile()
    plain = plain_plan(profile=profile)
    helped = with_help(plain, help_op(), 1)
    assert helpers_gain(helped, MeasuredDurations(profile, {})) == pytest.approx(2.0)
    samples = {timing_key(Op(OpKind.PRECONDITION, 0, None, 0)): [0.3], timing_key(help_op()): [0.1]}
    assert helpers_gain(helped, MeasuredDurations(profile, samples)) < 0
    assert helpers_gain(plain, MeasuredDurations(profile, samples)) == 0.0
    assert without_help(helped).steps == plain.steps
    two = with_help(helped, help_op("l0.1"), 1)
    samples[timing_key(help_op("l0.1"))] = [0.2]
    unhelped = MeasuredDurations(profile, samples).helping(two.helped).unhelped()
    assert unhelped.work(Op(OpKind.PRECONDITION, 0, None, 0)) == pytest.approx(0.3 + 0.1 + 0.2), (
        "every helped layer back"
    )


def test_profile_sizes_round_trip():
    profile = linked_profile()
    again = profile_from_dict(profile.to_dict())
    assert again.stages[0].p2p_bytes == 500 and again.stages[0].layers[0].weight_bytes == WEIGHT
    assert again.link_speed == pytest.approx(LINK)
    assert linked_profile(link=False).link_speed == 0.0


def test_helpers_key_is_refused_where_it_cannot_work(alone):
    from pipefisher.config import ConfigError, config_from_dict

    def config(method, **pipeline):
        return config_from_dict(
            {"optimizer": {"name": method}, method: {"helpers": True}, "pipeline": {"stages": 2, **pipeline}}
        )

    assert config("muon").muon.helpers
    assert config("kfac").kfac.helpers
    assert config("shampoo").shampoo.helpers
    assert config("soap").soap.helpers
    with pytest.raises(
        ConfigError, match=r"^muon_alone.helpers: Muon alone's per-step work cannot run on another rank"
    ):
        config(alone.name)
    with pytest.raises(ConfigError, match=r"^shampoo.helpers: its P op takes the products before clipping"):
        config_from_dict(
            {
                "optimizer": {"name": "shampoo"},
                "shampoo": {"helpers": True, "grafting": "none"},
                "pipeline": {"stages": 2},
            }
        )
    for pipeline in ({"tensor_parallel": 2}, {"data_parallel": 2}, {"schedule": "chimera"}):
        with pytest.raises(ConfigError, match=r"^kfac.helpers: not with pipeline.tensor_parallel > 1, pipeline.data"):
            config("kfac", **pipeline)


def test_shampoo_takes_its_products_in_a_p_op_only_with_helpers_on_one_pipeline():
    """Shampoo's products are its optimizer step's unless `helpers` is on and a stage is held once
    and unsharded: then they are a P op's (flop count and plan), which helpers can share."""
    from pipefisher.config import config_from_dict
    from pipefisher.core.profile_flops import STEP_END_FLOPS
    from pipefisher.methods.flops import MatrixShape
    from pipefisher.methods.shampoo.flops import task_flops
    from pipefisher.methods.shampoo.method import ShampooConfig

    plain, helped = ShampooConfig(), ShampooConfig(helpers=True)
    assert not plain.precondition_op(1, 0)
    assert helped.precondition_op(1, 0) and helped.precondition_op(1, 1)
    assert not helped.precondition_op(2, 0) and not helped.precondition_op(1, 2)
    shape = MatrixShape(rows=256, cols=64)
    assert set(task_flops(plain, shape, 1, 1)) - set(task_flops(helped, shape, 1, 1)) == {STEP_END_FLOPS}
    assert (
        task_flops(helped, shape, 1, 1)["precondition"].matmul
        == task_flops(plain, shape, 1, 1)[STEP_END_FLOPS].matmul
        > 0
    )

    def run(**section):
        data = {"optimizer": {"name": "shampoo"}, "shampoo": section, "pipeline": {"stages": 2}}
        return config_from_dict(data)

    assert run(helpers=True).precondition_op and not run().precondition_op
    profile = layered_profile(2, 4, spread=False, method="shampoo")
    plans = {
        precondition: after_step_plan(
            get_schedule("1f1b", 2, 4), profile, task_rules("shampoo"), 1, precondition=precondition
        )
        for precondition in (True, False)
    }
    assert sorted(op.stage for op in plans[True].curvature_ops() if op.kind is OpKind.PRECONDITION) == [0, 1]
    assert not any(op.kind is OpKind.PRECONDITION for op in plans[False].curvature_ops())
