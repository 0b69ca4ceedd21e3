"""A model kind is a plugin: the residual MLP of `_residual_model`, declared and registered
outside the package, goes through the run file's checks and a pipelined run without a line of
the package naming it, and a 2-stage run equals its single-process reference (losses and
parameters to rtol 1e-5, as the built-in models)."""

import subprocess
from pathlib import Path

import pytest

from _workers import assert_equal_to_reference
from pipefisher.config import ConfigError, config_from_dict

PACKAGE = Path(__file__).resolve().parents[2] / "pipefisher"


@pytest.fixture
def residual():
    """The kind, registered in this process for the test (spawned ranks import it themselves when
    they unpickle its worker)."""
    import _residual_model

    with _residual_model.registered() as kind:
        yield kind


def residual_run(model=None, **pipeline):
    """Two stages of a 4-block residual MLP, 4 micro-batches of 2, in-order mode, SGD, 3 steps."""
    return config_from_dict(
        {
            "model": {
                "kind": "residual",
                "layers": 4,
                "hidden": 16,
                "seq_len": 4,
                "input_dim": 8,
                "output_dim": 3,
                **(model or {}),
            },
            "data": {"micro_batch_size": 2},
            "pipeline": {"stages": 2, "micro_batches": 4, **pipeline},
            "optimizer": {"name": "sgd", "lr": 0.1},
            "run": {"steps": 3, "timeout": 30, "master_port": 0, "in_order": True},
        }
    )


def test_the_package_never_names_the_kind():
    found = subprocess.run(
        ["grep", "-rli", "_residual_model\\|ResidualRegression", str(PACKAGE)], capture_output=True, text=True
    )
    assert found.stdout == ""


def test_an_unregistered_kind_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"^model.kind: 'residual' is not one of transformer, mlp, bert, hf"):
        residual_run()


def test_its_declaration_drives_the_run_file_checks(residual):
    assert residual_run().model.identity == "residual layers 4 hidden 16"
    with pytest.raises(
        ConfigError, match=r"^model.heads: read by model.kind transformer; this run's model.kind is residual"
    ):
        residual_run({"heads": 4})
    with pytest.raises(ConfigError, match=r"^model.layers: 3 blocks cannot be split into 2 equal stages"):
        residual_run({"layers": 3})
    with pytest.raises(
        ConfigError, match=r"^data.kind: 'bert' does not fit model.kind 'residual'; it needs data.kind synthetic"
    ):
        config_from_dict({"model": {"kind": "residual"}, "data": {"kind": "bert"}})
    with pytest.raises(
        ConfigError, match=r"^pipeline.tensor_parallel: model.kind residual has no tensor-parallel split"
    ):
        residual_run(tensor_parallel=2)


def test_the_planner_says_it_has_no_sizes(residual):
    from pipefisher.planning.planner.model_sizes import PlanError, model_sizes

    with pytest.raises(PlanError, match=r"^model.kind: residual has no attention blocks"):
        model_sizes(residual_run())


@pytest.mark.dist
def test_a_pipelined_run_equals_its_reference(residual):
    import _residual_model

    assert_equal_to_reference(residual_run(), parameter_atol=1e-6, worker=_residual_model.pipelined)
