"""Run-file semantics that are not just parsing: the curvature methods' own optimizer settings, split hints."""

import re

import pytest

from pipefisher.config import ConfigError, config_from_dict, split_hint


def test_kfac_lr_and_momentum_apply_to_kfac_runs_only():
    data = {"optimizer": {"name": "lamb", "lr": 0.03}, "kfac": {"lr": 0.1, "momentum": 0.9}}
    lamb = config_from_dict(data)
    assert (lamb.optimizer_settings.lr, lamb.optimizer_settings.momentum) == (0.03, 0.0)
    kfac = lamb.with_overrides(optimizer={"name": "kfac"})
    assert (kfac.optimizer_settings.lr, kfac.optimizer_settings.momentum) == (0.1, 0.9)
    unset = config_from_dict({"optimizer": {"name": "kfac", "lr": 0.2, "momentum": 0.5}})
    assert (unset.optimizer_settings.lr, unset.optimizer_settings.momentum) == (0.2, 0.5), "0 means the optimizer's"


@pytest.mark.parametrize(
    "kfac, message",
    [
        ({"lr": -1.0}, "kfac.lr: -1 must be >= 0"),
        ({"momentum": 1.0}, "kfac.momentum: 1 must be in [0, 1)"),
        ({"percentile": 0}, "kfac.percentile: 0 must be in (0, 100] (50 = the median)"),
        ({"max_capture_mb": -1}, "kfac.max_capture_mb: -1 must be >= 0 (0 = no cap)"),
        ({"max_refresh_steps": -1}, "kfac.max_refresh_steps: -1 must be >= 0 (0 = no cap)"),
    ],
)
def test_bad_kfac_optimizer_settings_are_refused(kfac, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({"kfac": kfac})


def test_the_section_of_the_runs_curvature_method_applies():
    data = {
        "optimizer": {"name": "shampoo", "lr": 0.03},
        "kfac": {"lr": 0.1},
        "shampoo": {"lr": 0.002, "momentum": 0.9},
    }
    shampoo = config_from_dict(data)
    assert shampoo.curvature is shampoo.shampoo
    assert (shampoo.optimizer_settings.lr, shampoo.optimizer_settings.momentum) == (0.002, 0.9)
    assert shampoo.with_overrides(optimizer={"name": "kfac"}).optimizer_settings.lr == 0.1
    assert shampoo.with_overrides(optimizer={"name": "adamw"}).curvature is None


@pytest.mark.parametrize(
    "shampoo, message",
    [
        ({"beta2": 0.0}, "shampoo.beta2: 0 must be in (0, 1] (1 = a plain sum)"),
        ({"epsilon": 0}, "shampoo.epsilon: 0 must be positive"),
        ({"block_size": 0}, "shampoo.block_size: 0 must be positive"),
        ({"refresh_steps": -1}, "shampoo.refresh_steps: -1 must be >= 0 (0 lets the packer choose)"),
        ({"root": "cholesky"}, "shampoo.root: 'cholesky' is not one of eigen, newton"),
        ({"grafting": "adagrad"}, "shampoo.grafting: 'adagrad' is not one of adam, sgd, none"),
        ({"start_step": -2}, "shampoo.start_step: -2 must be >= 0"),
        ({"damping": 0.1}, "shampoo.damping: unknown key; allowed keys: lr, momentum"),
    ],
)
def test_bad_shampoo_settings_are_refused_by_key(shampoo, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({"optimizer": {"name": "shampoo"}, "shampoo": shampoo})


@pytest.mark.parametrize(
    "data, message",
    [
        ({"model": {"kind": "bert", "dropout": 1.5}, "data": {"kind": "bert"}}, "model.dropout: 1.5 must be in [0, 1)"),
        ({"optimizer": {"betas": [0.9, 1.5]}}, "optimizer.betas[1]: 1.5 must be in [0, 1)"),
        ({"optimizer": {"momentum": 1.0}}, "optimizer.momentum: 1 must be in [0, 1)"),
        ({"optimizer": {"weight_decay": -0.1}}, "optimizer.weight_decay: -0.1 must be >= 0"),
        ({"optimizer": {"warmup_steps": -5}}, "optimizer.warmup_steps: -5 must be >= 0"),
        (
            {"shampoo": {"statistics_dtype": "float16"}},
            "shampoo.statistics_dtype: 'float16' is not one of float64, float32",
        ),
        ({"data": {"kind": "bert", "vocab_size": 0}, "model": {"kind": "bert"}}, "data.vocab_size: 0 must be positive"),
    ],
)
def test_numbers_out_of_their_documented_range_are_refused_by_key(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict(data)


def test_split_hint_lists_the_divisors():
    assert split_hint(4, "pipeline.stages") == "make pipeline.stages a divisor of 4: 1, 2 or 4"
    assert split_hint(1, "pipeline.stages") == "make pipeline.stages a divisor of 1: 1"
    assert split_hint(12, "x").endswith("1, 2, 3, 4, 6 or 12")


def test_packer_settings_reach_the_packer():
    from pipefisher.runtime.training.pipefisher_run import pack_options

    config = config_from_dict(
        {"kfac": {"percentile": 75, "max_refresh_steps": 6, "max_capture_mb": 512, "margin": 0.1}}
    )
    options = pack_options(config)
    assert (options.percentile, options.max_refresh_steps, options.max_capture_mb, options.margin) == (75, 6, 512, 0.1)
    assert pack_options(config_from_dict({})).max_capture_mb is None


@pytest.mark.parametrize(
    "data, message",
    [
        ({"kfac": {"dampng": 0.1}}, "kfac.dampng: unknown key; did you mean damping?"),
        ({"optimzer": {"lr": 0.1}}, "optimzer: unknown section; did you mean optimizer?"),
    ],
)
def test_a_mistyped_key_or_section_names_the_one_it_meant(data, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        config_from_dict(data)


def test_numbers_are_read_as_people_write_them(tmp_path):
    from pipefisher.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(
        "optimizer:\n  lr: 3e-2\n  eps: 1E-9\n  momentum: .5\nkfac:\n  damping: 1.5e-3\nrun:\n  steps: 1_000\n  seed: 1e3\n"
    )
    config = load_config(path)
    assert (config.optimizer.lr, config.optimizer.eps, config.optimizer.momentum, config.kfac.damping) == (
        0.03,
        1e-9,
        0.5,
        1.5e-3,
    )
    assert (config.run.steps, config.run.seed) == (1000, 1000) and type(config.run.seed) is int


@pytest.mark.parametrize(
    "data, message",
    [
        ({"run": {"steps": 2.5}}, "run.steps: expected an integer, got 2.5"),
        ({"run": {"in_order": 1}}, "run.in_order: expected true or false, got 1"),
        ({"optimizer": {"lr": "1e-3"}}, "optimizer.lr: expected a number, got '1e-3'"),
        ({"optimizer": {"weight_decay": float("inf")}}, "optimizer.weight_decay: expected a finite number, got inf"),
        (
            {"run": {"steps": 10**23}},
            "run.steps: 100000000000000000000000 exceeds 1,000,000,000, more steps than any run takes",
        ),
        (
            {"pipeline": {"data_parallel": 2**21}},
            "pipeline.data_parallel: 2097152 exceeds 1,048,576, more than any cluster could run",
        ),
        ({"kfac": {"refresh_steps": 10**12}}, "kfac.refresh_steps: 1000000000000 exceeds 1,000,000,000"),
        ({"run": {"seed": 2**64}}, "run.seed: 18446744073709551616 is beyond a 64-bit integer"),
    ],
)
def test_integers_bools_and_counts_are_refused_by_key_beyond_what_a_run_reaches(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict(data)


@pytest.mark.parametrize(
    "text, line",
    [
        ("model:\n\tkind: bert\n", "run.yaml:2:1: a tab character; YAML indents with spaces"),
        ("model:\n  kind: bert\n  layers 4\n", "run.yaml:3:3: a key without its ':'; write `key: value`"),
        (
            "model:\n  kind bert\n  layers: 4\n",
            "run.yaml:3:9: a ':' where no key may start; is the line above missing its ':'",
        ),
        ("optimizer:\n  betas: [0.9, 0.95\n", "run.yaml:3:1: not valid YAML: expected ',' or ']'"),
        ("model:\n  layers: 4\n  layers: 8\n", "run.yaml:3:3: 'layers' is written twice in this mapping; keep one"),
    ],
)
def test_a_yaml_mistake_is_one_line_with_its_place(tmp_path, text, line):
    from pipefisher.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{tmp_path}/{line}") and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"model": {"kind": "bert", "hidden": 256}, "data": {"kind": "bert"}},
            "model.hidden: read by model.kind transformer or mlp; this run's model.kind is bert "
            "(its size comes from model.preset or model.config_json); drop model.hidden",
        ),
        (
            {"model": {"kind": "transformer", "preset": "bert-base"}},
            "model.preset: read by model.kind bert; this run's model.kind is transformer; drop model.preset",
        ),
        (
            {"model": {"kind": "mlp", "heads": 4}},
            "model.heads: read by model.kind transformer; this run's model.kind is mlp; drop model.heads",
        ),
        (
            {"data": {"kind": "synthetic", "vocab_size": 300}},
            "data.vocab_size: read by data.kind bert or causal; this run's data.kind is synthetic (it makes regression data from data.seed alone)",
        ),
        (
            {"model": {"kind": "hf"}, "data": {"kind": "causal", "mask_prob": 0.2}},
            "data.mask_prob: read by data.kind bert or shards; this run's data.kind is causal",
        ),
    ],
)
def test_a_key_the_chosen_kind_does_not_read_is_refused_naming_what_reads_it(data, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        config_from_dict(data)


def test_defaults_and_other_methods_sections_are_not_refused():
    config = config_from_dict(
        {"model": {"kind": "bert", "hidden": 32}, "data": {"kind": "bert"}, "shampoo": {"lr": 0.1}}
    )
    assert config.model.hidden == 32 and config.optimizer.name == "sgd", (
        "a default, and a section for --optimizer shampoo"
    )
