"""experiments/host_proxy.py: the ATen op counts CI keeps are exact (the same on every run, one
block's worth more for each block added), and the table reports them per block."""

from experiments import host_proxy
from pipefisher.config import config_from_dict


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
