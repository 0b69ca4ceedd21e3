"""Zero-bubble schedules (ZB-H1, ZB-V, DualPipeV): closed forms of their bubbles and memory,
validation, the V placement, the registry and the run config's stage count. Planning only.

Units: F, B, W are the times of a forward, an input gradient and a weight gradient of one
micro-batch on one stage (for the V schedules: on one chunk, half a rank's share of the model);
peaks count micro-batch activations per stage (per chunk for the V schedules), held from the
forward until the weight gradient.
"""

import itertools
import json
import re

import pytest

from pipefisher.config import ConfigError, config_from_dict
from pipefisher.core.ir import OpKind, Schedule, ScheduleError, peak_activations, peak_pending_weights
from pipefisher.core.profile import Profile, uniform_profile
from pipefisher.planning.simulate import simulate
from pipefisher.schedules import SCHEDULES, chunks_per_rank, get_schedule
from pipefisher.schedules.validate import validate

from builders import layered_profile

ZERO_BUBBLE = ("zb-h1", "zbv", "dualpipev")


def split_profile(num_stages: int, forward: float, input_gradient: float, weight: float) -> Profile:
    return layered_profile(
        num_stages,
        0,
        forward=forward,
        backward=input_gradient + weight,
        weight=weight,
        time_unit="units",
        device="test",
    )


def bubbles(schedule: Schedule, profile: Profile) -> list[float]:
    timeline = simulate(schedule, profile)
    return [timeline.bubble_time(rank) for rank in range(schedule.num_ranks)]


def peak_until_input_gradient(schedule: Schedule, rank: int) -> int:
    """Activations held from the forward until the input gradient (the weight gradients left out)."""
    return peak_activations([op for op in schedule.ranks[rank] if op.kind is not OpKind.WEIGHT])


def min_micro_batches(name: str, d: int) -> int:
    return 2 * d if name == "dualpipev" else 1


def grid():
    for name in ZERO_BUBBLE:
        for d in range(1, 7):
            for n in range(min_micro_batches(name, d), 3 * d + 2):
                yield name, d, n


@pytest.mark.parametrize("name, d, n", list(grid()))
def test_every_zero_bubble_schedule_validates_and_splits_every_backward(name, d, n):
    schedule = validate(get_schedule(name, d, n))
    assert schedule.num_ranks == d and schedule.num_stages == d * chunks_per_rank(name)
    kinds = [op.kind for _, _, op in schedule.ops()]
    per_kind = schedule.num_stages * n
    assert kinds.count(OpKind.FORWARD) == kinds.count(OpKind.BACKWARD) == kinds.count(OpKind.WEIGHT) == per_kind


# ZB-H1: Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 2.1 and Figure 3
# (1F1B idles (p−1)(T_F+T_B+T_W) per device, ZB-H1 (p−1)(T_F+T_B−T_W): a third at T_F = T_B = T_W).
@pytest.mark.parametrize("d, n", [(d, n) for d in range(2, 7) for n in range(d, 3 * d + 1)])
def test_zb_h1_idles_a_third_of_1f1b_with_unit_forward_input_and_weight_gradients(d, n):
    profile = uniform_profile(d)  # forward 1, backward 2: split into input gradient 1 and weight gradient 1
    assert bubbles(get_schedule("zb-h1", d, n), profile) == [d - 1] * d
    assert bubbles(get_schedule("1f1b", d, n), profile) == [3 * (d - 1)] * d


@pytest.mark.parametrize(
    "f, b, w", [(f, b, w) for f, b, w in itertools.product((0.5, 1, 2, 3), repeat=3) if w <= min(f, b)]
)
def test_zb_h1_closed_form_holds_while_the_weight_gradient_is_the_shortest(f, b, w):
    for d in (2, 3, 5):
        for n in (d, d + 1, 2 * d + 1):
            assert bubbles(get_schedule("zb-h1", d, n), split_profile(d, f, b, w)) == pytest.approx(
                [(d - 1) * (f + b - w)] * d
            )


def test_zb_h1_idles_more_than_the_closed_form_when_the_weight_gradient_is_longer():
    d, n, f, b, w = 4, 8, 1.0, 0.5, 1.0
    assert max(bubbles(get_schedule("zb-h1", d, n), split_profile(d, f, b, w))) > (d - 1) * (f + b - w)


@pytest.mark.parametrize("d, n", [(d, n) for d in range(1, 7) for n in range(d, 2 * d + 2)])
def test_zb_h1_memory(d, n):
    """1F1B's activations until the input gradient (D−s on stage s); until the weight gradient D on
    every stage, 1F1B's peak (stage 0's), as the paper's Section 2.1 bounds it; s+1 weight
    gradients pending on stage s."""
    schedule = get_schedule("zb-h1", d, n)
    one_f_one_b = get_schedule("1f1b", d, n)
    for stage in range(d):
        assert peak_until_input_gradient(schedule, stage) == peak_activations(one_f_one_b.ranks[stage]) == d - stage
        assert peak_activations(schedule.ranks[stage]) == d == max(map(peak_activations, one_f_one_b.ranks))
        assert peak_pending_weights(schedule.ranks[stage]) == stage + 1


def test_zb_h1_small_case_lags_weight_gradients_by_the_stage():
    assert [" ".join(map(str, ops)) for ops in get_schedule("zb-h1", 3, 4).ranks] == [
        "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
        "1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3",
    ]


# ZB-V: Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241v2, Section 6, and "Pipeline
# Parallelism with Controllable Memory" (NeurIPS 2024): 1F1B's activation memory, bubble close to
# zero at T_F = T_B = T_W. Derived here (and held below): with t = T_F = T_B = T_W per chunk and
# N ≥ 2D−1, every device idles (D−1)·t per step, only in the warm-up; with a whole stage's
# F = B = W = 1 (t = 1/2) that is (D−1)/2: half of ZB-H1's D−1, a sixth of 1F1B's 3(D−1).
@pytest.mark.parametrize("d, n", [(d, n) for d in range(1, 7) for n in range(2 * d - 1, 4 * d + 1) if n >= 1])
def test_zbv_idles_half_of_zb_h1_with_equal_times(d, n):
    zbv = get_schedule("zbv", d, n)
    per_chunk = uniform_profile(2 * d, forward=0.5, backward=1.0)  # a whole stage: forward 1, backward 2
    assert bubbles(zbv, per_chunk) == [(d - 1) / 2] * d
    if n >= d:
        assert bubbles(get_schedule("zb-h1", d, n), uniform_profile(d)) == [d - 1] * d


@pytest.mark.parametrize("d, t", [(2, 1.0), (4, 0.25), (5, 3.0)])
def test_zbv_bubble_scales_with_the_chunk_time(d, t):
    assert bubbles(get_schedule("zbv", d, 3 * d), split_profile(2 * d, t, t, t)) == pytest.approx([(d - 1) * t] * d)


@pytest.mark.parametrize("d, n", [(d, n) for d in range(1, 7) for n in range(2 * d - 1, 3 * d + 1)])
def test_zbv_memory_is_1f1b_peak(d, n):
    """2D chunk activations = D whole-stage activations on every rank: 1F1B's peak; rank r has at
    most 2r+1 weight gradients pending."""
    schedule = get_schedule("zbv", d, n)
    for rank in range(d):
        assert (
            peak_activations(schedule.ranks[rank]) / 2
            == d
            == max(map(peak_activations, get_schedule("1f1b", d, n).ranks))
        )
        assert peak_pending_weights(schedule.ranks[rank]) == 2 * rank + 1


def test_zbv_short_steps_run_with_less_memory():
    schedule = validate(get_schedule("zbv", 4, 2))
    assert max(map(peak_activations, schedule.ranks)) < 2 * 4


# DualPipeV: DeepSeek-V3 technical report (arXiv:2412.19437), Section 3.2.1, and DeepSeek's DualPipe
# repository ("cut-in-half" DualPipeV). Without the F&B overlap it is built for (pipefisher runs an
# overlapped step as F then B), its order idles as ZB-V does, (D−1)·t at T_F = T_B = T_W = t per
# chunk, and holds one chunk activation more than ZB-V: 2D+1 per rank.
@pytest.mark.parametrize("d, n", [(d, n) for d in range(1, 7) for n in range(2 * d, 4 * d + 1)])
def test_dualpipev_against_zbv(d, n):
    dualpipev, zbv = get_schedule("dualpipev", d, n), get_schedule("zbv", d, n)
    per_chunk = uniform_profile(2 * d, forward=0.5, backward=1.0)
    assert bubbles(dualpipev, per_chunk) == bubbles(zbv, per_chunk) == [(d - 1) / 2] * d
    for rank in range(d):
        assert peak_activations(dualpipev.ranks[rank]) == peak_activations(zbv.ranks[rank]) + 1 == 2 * d + 1
        assert peak_pending_weights(dualpipev.ranks[rank]) == rank + 1


def test_dualpipev_needs_two_micro_batches_per_rank_and_says_which():
    with pytest.raises(
        ScheduleError, match=re.escape("dualpipev: micro-batches N=7 must be at least 2 x stages D = 8; try 8")
    ):
        get_schedule("dualpipev", 4, 7)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_v_placement(name, d):
    schedule = get_schedule(name, d, 2 * d)
    assert schedule.params == {"chunks": 2}
    assert schedule.placement == {(0, s): (s if s < d else 2 * d - 1 - s) for s in range(2 * d)}
    assert schedule.placement[(0, d - 1)] == schedule.placement[(0, d)] == d - 1, "the turn of the V is local"
    assert schedule.placement[(0, 0)] == schedule.placement[(0, 2 * d - 1)] == 0, (
        "rank 0 holds the first stage and the loss"
    )
    for rank in range(d):
        assert {op.stage for op in schedule.ranks[rank]} == {rank, 2 * d - 1 - rank}


def test_torch_builds_the_same_orders():
    """ZB-H1, ZB-V and DualPipeV give each rank the op order of PyTorch's ScheduleInterleavedZeroBubble
    (one stage per rank), ScheduleZBVZeroBubble and ScheduleDualPipeV (a full backward: B then W)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from types import SimpleNamespace

    kinds = {
        schedules._ComputationType.FORWARD: ["F"],
        schedules._ComputationType.BACKWARD_INPUT: ["B"],
        schedules._ComputationType.BACKWARD_WEIGHT: ["W"],
        schedules._ComputationType.FULL_BACKWARD: ["B", "W"],
    }

    def torch_order(cls, rank, **fields):
        actions = cls._calculate_single_rank_operations(SimpleNamespace(**fields), rank)
        steps = [sub for action in actions if action is not None for sub in (action.sub_actions or (action,))]
        return [f"{a.stage_index}{kind}{a.microbatch_index}" for a in steps for kind in kinds[a.computation_type]]

    for d in (1, 2, 3, 4):
        for n in range(2 * d, 3 * d + 1):
            cases = [("zbv", schedules.ScheduleZBVZeroBubble, {}), ("dualpipev", schedules.ScheduleDualPipeV, {})]
            if n % d == 0:
                rounds = n // d
                cases.append(
                    (
                        "zb-h1",
                        schedules.ScheduleInterleavedZeroBubble,
                        {"n_local_stages": 1, "number_of_rounds": rounds, "microbatches_per_round": n // rounds},
                    )
                )
            for name, cls, extra in cases:
                ours = get_schedule(name, d, n)
                for rank in range(d):
                    fields = {"pp_group_size": d, "_n_microbatches": n, "num_stages": ours.num_stages, **extra}
                    assert [str(op) for op in ours.ranks[rank]] == torch_order(cls, rank, **fields), (name, d, n, rank)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_round_trip_through_schedule_json(name):
    schedule = get_schedule(name, 3, 6)
    again = Schedule.from_dict(schedule.to_dict())
    assert again == schedule
    assert "2W0" in [text for ops in schedule.to_dict()["ranks"] for text in ops]


def test_registry():
    assert set(ZERO_BUBBLE) <= set(SCHEDULES)
    assert [chunks_per_rank(name) for name in ("gpipe", "1f1b", "chimera", "zb-h1", "zbv", "dualpipev")] == [
        1,
        1,
        1,
        1,
        2,
        2,
    ]
    assert chunks_per_rank("interleaved") == 2 and chunks_per_rank("interleaved", 3) == 3
    assert get_schedule("zbv", 2, 4, chunks=2).num_stages == 4
    with pytest.raises(
        ScheduleError, match=re.escape("chunks apply to the interleaved schedule only, not 'zbv' (it has 2 per rank)")
    ):
        get_schedule("zbv", 2, 4, chunks=3)
    with pytest.raises(
        ScheduleError, match=re.escape("chunks apply to the interleaved schedule only, not 'zb-h1' (it has 1 per rank)")
    ):
        get_schedule("zb-h1", 2, 4, chunks=2)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb-h2'; choose one of .*zb-h1, zbv, dualpipev"):
        get_schedule("zb-h2", 2, 4)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        chunks_per_rank("zb-h2")


@pytest.mark.parametrize(
    "name, stages, layers, model_stages",
    [
        ("zbv", 2, 4, 4),
        ("dualpipev", 2, 8, 4),
        ("zb-h1", 2, 2, 2),
        ("interleaved", 2, 8, 4),
        ("1f1b", 4, 4, 4),
    ],
)
def test_config_cuts_the_model_into_the_schedules_stages(name, stages, layers, model_stages):
    config = config_from_dict(
        {"pipeline": {"schedule": name, "stages": stages, "micro_batches": 4}, "model": {"layers": layers}}
    )
    assert config.model_chunks == model_stages
    schedule = get_schedule(name, stages, 4, chunks_per_rank(name, config.pipeline.chunks))
    assert schedule.num_stages == model_stages


def test_config_error_names_the_v_schedules_product():
    message = (
        "model.layers: 6 blocks cannot be split into 4 equal stages (pipeline.stages 2 x 2 chunks per rank of zbv); "
        "make 2 x pipeline.stages a divisor of 6"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({"pipeline": {"schedule": "zbv", "stages": 2}, "model": {"layers": 6}})


def test_cli_simulates_zero_bubble_schedules(capsys):
    from pipefisher.cli.main import main

    assert main(["simulate", "--schedule", "zb-h1", "--stages", "4", "--micro-batches", "8"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("zb-h1: D=4, N=8; step time 27 units, bubble 11.1 % of device time")
    assert "pending W [mb]" in table
    assert main(["simulate", "--schedule", "zbv", "-D", "4", "-N", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["chunks"], data["step_time"]) == (2, 25.5), "each chunk costs half a rank's share: 0.5 + 0.5 + 0.5"
    assert [d["peak_activations"] for d in data["devices"]] == [8] * 4
    assert [d["peak_pending_weights"] for d in data["devices"]] == [1, 3, 5, 7]
