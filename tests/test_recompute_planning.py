"""The predicted cost of activation recomputation (`pipefisher.planning.recompute`)."""

import typing

import pytest

from builders import layered_profile
from pipefisher.config import ModelConfig
from pipefisher.core.profile import RECOMPUTE_MODES, Profile, ProfileError, StageProfile, profile_from_dict
from pipefisher.planning.recompute import block_flops, recompute_forward_share, with_recompute


def test_the_modes_are_the_run_files():
    assert RECOMPUTE_MODES == typing.get_args(typing.get_type_hints(ModelConfig)["recompute"])


def test_shares_by_flops():
    linear, core = block_flops(hidden=128, ffn=512, seq_len=64)
    assert (linear, core) == (2 * 64 * (4 * 128**2 + 2 * 128 * 512), 4 * 64**2 * 128)
    assert recompute_forward_share("none", 128, 512, 64, blocks=2) == 0.0
    assert recompute_forward_share("blocks", 128, 512, 64, blocks=2) == 1.0
    assert recompute_forward_share("blocks", 128, 512, 64, blocks=2, other_flops=2 * (linear + core)) == 0.5
    assert recompute_forward_share("selective", 128, 512, 64, blocks=3) == pytest.approx(core / (linear + core))
    assert recompute_forward_share("selective", 128, 512, 1024, 1) > recompute_forward_share(
        "selective", 128, 512, 64, 1
    ), "the core's share grows with the sequence"
    with pytest.raises(ValueError, match="mode: 'all'"):
        recompute_forward_share("all", 128, 512, 64, 1)


def test_the_backward_grows_by_the_recomputed_forward_and_the_weight_gradient_stays():
    measured = layered_profile(2, forward=2.0, backward=4.0, weight=1.5)
    unknown = layered_profile(2, forward=2.0, backward=4.0)  # weight 0: half of the backward
    for profile, weight in ((measured, 1.5), (unknown, 2.0)):
        predicted = with_recompute(profile, "blocks", [1.0, 0.25])
        assert predicted.recompute == "blocks"
        assert [stage.backward for stage in predicted.stages] == [6.0, 4.5]
        assert [stage.forward for stage in predicted.stages] == [2.0, 2.0]
        assert [stage.weight_gradient for stage in predicted.stages] == [weight, weight]
        assert predicted.stages[0].layers == profile.stages[0].layers
    assert with_recompute(measured, "none", [0.0, 0.0]) is measured


def test_samples_shift_with_the_backward_and_the_mode_round_trips():
    stage = StageProfile(forward=2.0, backward=4.0, samples={"backward": [3.0, 4.0, 5.0], "forward": [2.0, 2.0, 2.0]})
    profile = with_recompute(Profile(stages=(stage,)), "selective", [0.5])
    assert profile.stages[0].samples["backward"] == (4.0, 5.0, 6.0)
    assert profile_from_dict(profile.to_dict()) == profile
    assert "recompute" not in layered_profile(1).to_dict(), "written only when not none"


def test_refusals_name_the_field():
    recomputed = with_recompute(layered_profile(2), "blocks", [1.0, 1.0])
    with pytest.raises(ProfileError, match="recompute: the profile was measured with model.recompute blocks"):
        with_recompute(recomputed, "selective", [0.1, 0.1])
    with pytest.raises(ValueError, match="forward_share"):
        with_recompute(layered_profile(2), "blocks", [1.0])
    with pytest.raises(ValueError, match="forward_share"):
        with_recompute(layered_profile(2), "blocks", [1.0, 1.5])
    with pytest.raises(ProfileError, match="recompute: 'some' is not one of none, selective, blocks"):
        profile_from_dict({**layered_profile(1).to_dict(), "recompute": "some"})
