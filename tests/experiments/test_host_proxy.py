"""experiments/host_proxy.py: the ATen op counts CI keeps are exact (the same on every run, one
block's worth more for each block added), and the table reports them per block; micro-batches as
built before issue 43 (`--legacy`) are the ones built now less what issue 43 added."""

import torch

from experiments import host_proxy
from pipefisher.config import config_from_dict
from pipefisher.runtime.training import build_run


def transformer(layers: int):
    """The tiny regression Transformer as one stage, `layers` blocks."""
    return config_from_dict(
        {
            "model": {"kind": "transformer", "layers": layers, "hidden": 16, "heads": 2, "ffn": 32},
            "pipeline": {"stages": 1, "micro_batches": 1},
        }
    )


def test_counts_are_exact_and_grow_by_one_block_per_block():
    two, again = (
        host_proxy.stage_ops(transformer(2), "two", "fp32"),
        host_proxy.stage_ops(transformer(2), "two", "fp32"),
    )
    assert (two.forward, two.backward) == (again.forward, again.backward)
    three, four = (host_proxy.stage_ops(transformer(n), str(n), "fp32") for n in (3, 4))
    assert (two.blocks, three.blocks, four.blocks) == (2, 3, 4)
    for side in ("forward", "backward"):
        block = getattr(three, side).total() - getattr(two, side).total()
        assert block > 0 and getattr(four, side).total() - getattr(three, side).total() == block
    assert two.forward["aten::mm"] + two.forward["aten::addmm"] + two.forward["aten::bmm"] > 0


def test_autocast_recasts_and_the_table_shows_it():
    fp32, bf16 = (host_proxy.stage_ops(transformer(2), "tiny", precision) for precision in ("fp32", "bf16"))
    assert bf16.recasts > fp32.recasts
    rows = host_proxy.table([(fp32, 1.0, 0.1), (bf16, 2.0, 0.05)])
    assert rows[2].startswith(f"| tiny | fp32 | 2 | {fp32.forward.total()} | {fp32.backward.total()} |")
    assert f"| {bf16.recasts} | 2.0 | 5% |" in rows[3]


def bert(cache: str):
    """The BERT demo's model (bert-4x128) at length 16 on its data, 2 stages."""
    return config_from_dict(
        {
            "model": {"kind": "bert", "preset": "bert-4x128", "seq_len": 16, "dropout": 0.0},
            "data": {"kind": "bert", "vocab_size": 300, "micro_batch_size": 2, "cache_dir": cache},
            "pipeline": {"stages": 2, "micro_batches": 2},
        }
    )


def test_legacy_micro_batches_and_the_last_stage_timed_on_both(tmp_path):
    config = bert(str(tmp_path))
    built = build_run(config).data_source(0, 0)
    legacy = host_proxy.legacy_batch(built)
    assert "mlm_positions" in built and "mlm_positions" not in legacy
    assert torch.equal(legacy["attention_mask"], built.get("attention_mask", torch.ones_like(built["input_ids"])))
    assert all(torch.equal(legacy[key], value) for key, value in built.items() if key != "mlm_positions")
    one = config.with_overrides(pipeline={"stages": 1})
    first, again = (host_proxy.stage_ops(one, "bert", "fp32", legacy=True) for _ in range(2))
    assert (first.forward, first.backward) == (again.forward, again.backward)
    assert first.blocks == 4 and first.forward["aten::addmm"] + first.forward["aten::mm"] > 0
    times = host_proxy.last_stage_times(config, "fp32", repeats=3)
    assert len(times.legacy) == len(times.built) == 3 and times.ratio > 0
