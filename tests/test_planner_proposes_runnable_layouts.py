"""Every layout the planner may propose is a run file `run` loads: the candidates follow the run's
own rules for the method's section (its `zero_problem`: ZeRO-1 where the method runs on owners,
ZeRO-2/3 without LAMB as the first-order rule; FSDP2's and the schedules' rules). Pure Python."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pipefisher.config import ConfigError, RunSettings, load_config
from pipefisher.methods.registry import methods
from pipefisher.planning.planner.candidates import SearchSpace, enumerate_layouts
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.planning.planner.table import run_file_of

RUN = Path(__file__).resolve().parents[1] / "schedules" / "bert-base-1f1b-4x4.yaml"
SECTIONS = (
    [({}, name) for name in methods()]
    + [({"first_order": "lamb"}, name) for name in methods()]
    + [({"grad_worker_fraction": 0.5}, "kfac")]
)


@pytest.mark.parametrize(("changes", "name"), SECTIONS)
def test_each_candidate_layout_loads_as_a_run_file(changes, name):
    config = load_config(RUN)
    raw = yaml.safe_load(RUN.read_text())
    raw[name] = {**(raw.get(name) or {}), **changes}
    section = replace(config.section(name), **changes)
    batch = config.data.micro_batch_size * config.pipeline.micro_batches * config.pipeline.data_parallel
    space = SearchSpace(8, batch, (8, 16, 32), None, run=RunSettings(precision="bf16"))
    layouts = enumerate_layouts(space, model_sizes(config), section.first_order, planned=name, section=section)
    assert any(layout.data_parallel > 1 for layout in layouts), "replicated layouts are among them"
    for layout in random.Random(0).sample(layouts, min(120, len(layouts))):
        run_file_of(raw, replace(layout, method=name, refresh_steps=2))  # raises ConfigError if run refuses it


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_sections_layout_rule_is_the_runs_for_gradient_workers_at_every_zero_stage(zero):
    """K-FAC with half the replicas as gradient workers: the section's `layout_problem` (what the
    planner asks) refuses exactly the ZeRO stages the run refuses, with the run's message."""
    config = load_config(RUN)
    section = replace(config.section("kfac"), grad_worker_fraction=0.5)
    problem = section.layout_problem("kfac", zero, 2)
    changes = {"optimizer": {"name": "kfac", "zero": zero}, "pipeline": {"data_parallel": 2}, "kfac": {}}
    changes["kfac"]["grad_worker_fraction"] = 0.5
    try:
        config.with_overrides(**changes)
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    assert refused == problem and bool(problem) == (zero >= 1)
