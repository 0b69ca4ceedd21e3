"""Tensor parallelism in the planning code: profiles carry their degree, the transformer profile
and the memory model count one rank's shards, pack/simulate check the degree, and the README's
table (experiments/tp_table.py) follows from those models."""

import importlib.util
import sys
from pathlib import Path

import pytest

from pipefisher.methods.kfac.method import KFAC
from pipefisher.methods.registry import methods
from pipefisher.cli.main import main
from pipefisher.core.profile import ProfileError, load_profile, profile_from_dict
from pipefisher.core.topology import Topology
from pipefisher.methods.kfac.memory import COUNTER_BYTES, FLAG_BYTES, KfacLayer
from pipefisher.planning.memory.state import optimizer_state, rank_memory
from pipefisher.planning.transformer_profile import BlockTimes, tensor_parallel_allreduce_ms, transformer_profile
from pipefisher.planning.memory.transformer_state import TransformerSizes, transformer_stage_states
from pipefisher.schedules import get_schedule

TIMES = BlockTimes(time_f=29.2, time_b=49.4, time_kron=7.3, time_inv=16.9, time_prec=1.2)
ROOT = Path(__file__).resolve().parents[1]


def kfac(name, inputs, outputs, bias):
    return KfacLayer(name, inputs + bias, outputs)


def test_a_profile_keeps_its_degree_and_writes_it_only_above_one(tmp_path):
    profile = transformer_profile(TIMES, 2, 2, 8, 16, 4, tensor_parallel=2, rules=KFAC.rules)
    path = tmp_path / "tp.yaml"
    profile.save(path)
    assert "tensor_parallel: 2" in path.read_text() and load_profile(path) == profile
    single = transformer_profile(TIMES, 2, 2, 8, 16, 4)
    assert single.tensor_parallel == 1 and "tensor_parallel" not in single.to_dict()


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_a_bad_degree_is_refused_naming_the_field(value):
    data = {**transformer_profile(TIMES, 2, 2, 8, 16).to_dict(), "tensor_parallel": value}
    with pytest.raises(ProfileError, match="^tensor_parallel: .* must be a positive integer"):
        profile_from_dict(data)


def test_degree_one_is_the_profile_of_before():
    before = transformer_profile(TIMES, 12, 4, 768, 3072, 32)
    assert transformer_profile(TIMES, 12, 4, 768, 3072, 32, tensor_parallel=1) == before
    assert all(stage.weight == 0 for stage in before.stages)


def test_layers_are_shards_whose_times_scale_by_their_sizes():
    hidden, ffn, rows = 1024, 4096, 32 * 128
    one = {
        layer.name: layer
        for stage in transformer_profile(TIMES, 2, 1, hidden, ffn, 32).stages
        for layer in stage.layers
    }
    two = {
        layer.name: layer
        for stage in transformer_profile(TIMES, 2, 1, hidden, ffn, 32, tensor_parallel=2, rules=KFAC.rules).stages
        for layer in stage.layers
    }
    query, query2 = one["block0.attention.query"], two["block0.attention.query"]  # column: 1024 -> 512 outputs
    # every shard sees the whole input: its A factor is built from half the rows, then summed
    assert query2.time("curvature", 0) == pytest.approx(query.time("curvature", 0) / 2) and query2.time(
        "refresh", 0
    ) == query.time("refresh", 0)
    assert query2.time("curvature", 1) == pytest.approx(query.time("curvature", 1) / 4) and query2.time(
        "refresh", 1
    ) == pytest.approx(query.time("refresh", 1) / 8)
    assert query2.precondition == pytest.approx(query.precondition * 1024 * 512 * 1536 / (1024 * 1024 * 2048))
    assert (query2.captured(0), query2.captured(1)) == (rows * 4 * 1024, rows * 4 * 512)
    out, out2 = one["block1.output"], two["block1.output"]  # row: 4096 -> 2048 inputs, the bias on shard 0
    assert out2.time("refresh", 0) == pytest.approx(
        out.time("refresh", 0) * (2048 + 1) ** 3 / (4096 + 1) ** 3
    ) and out2.time("refresh", 1) == out.time("refresh", 1)
    assert out2.time("curvature", 1) == pytest.approx(out.time("curvature", 1) / 2), (
        "the output gradient is whole on every shard: half the rows each"
    )
    assert (out2.captured(0), out2.captured(1)) == (rows * 4 * 2048, rows * 4 * 1024)


def test_forward_and_backward_are_a_share_plus_the_modelled_allreduces():
    profile = transformer_profile(
        TIMES,
        4,
        2,
        8,
        16,
        micro_batch_size=4,
        seq_len=2,
        tensor_parallel=2,
        tp_bandwidth_gbps=1e-6,
        rules=KFAC.rules,
    )
    # 4 x 2 tokens x 8 wide x 4 bytes = 256 bytes; a ring all-reduce over 2 sends 256 of them; 1e3 bytes/s: 256 ms
    assert tensor_parallel_allreduce_ms(256, 2, 1e-6) == pytest.approx(256.0)
    stage = profile.stages[0]  # 2 blocks
    assert stage.forward == pytest.approx(2 * (29.2 / 2 + 2 * 256.0))
    assert stage.backward == pytest.approx(2 * (49.4 / 2 + 2 * 256.0)) and stage.weight == pytest.approx(49.4 / 2)
    quiet = transformer_profile(TIMES, 4, 2, 8, 16, tensor_parallel=2, tp_bandwidth_gbps=None, rules=KFAC.rules)
    assert quiet.stages[0].forward == pytest.approx(29.2) and quiet.stages[0].weight == 0


def test_an_impossible_split_names_the_degree():
    with pytest.raises(ProfileError, match="^tensor_parallel: 8 features cannot be split into 3"):
        transformer_profile(TIMES, 2, 1, 8, 16, 4, tensor_parallel=3, rules=KFAC.rules)
    with pytest.raises(ProfileError, match="^micro_batch_size: needed"):
        transformer_profile(TIMES, 2, 1, 8, 16, tensor_parallel=2, rules=KFAC.rules)


@pytest.fixture
def profiles(tmp_path):
    paths = {}
    for degree in (1, 2):
        paths[degree] = tmp_path / f"tp{degree}.yaml"
        transformer_profile(TIMES, 4, 2, 64, 256, 8, tensor_parallel=degree, method="kfac", rules=KFAC.rules).save(
            paths[degree]
        )
    return paths


@pytest.mark.parametrize("command", ["pack", "simulate"])
def test_pack_and_simulate_take_the_profile_of_their_degree(command, profiles, capsys):
    args = [command, "--schedule", "1f1b", "-D", "2", "-N", "4", "--json"]
    assert main([*args, "--profile", str(profiles[2]), "--tensor-parallel", "2"]) == 0
    assert main([*args, "--profile", str(profiles[1])]) == 0
    capsys.readouterr()
    assert main([*args, "--profile", str(profiles[2])]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert f"--tensor-parallel 1: {profiles[2]} describes tensor_parallel 2; give --tensor-parallel 2" in error


def test_simulate_without_a_profile_takes_only_degree_one(capsys):
    assert main(["simulate", "--schedule", "1f1b", "-D", "2", "-N", "2", "--tensor-parallel", "2"]) == 2
    assert "unit times have no tensor-parallel model" in capsys.readouterr().err


def test_memory_counts_a_shard_of_each_split_linear_and_replicated_parts_whole():
    h, f, v, p = 8, 16, 10, 6
    sizes = TransformerSizes(blocks=2, hidden=h, ffn=f, vocab=v, max_positions=p)
    (one,) = transformer_stage_states(sizes, 1, kfac)
    (shard0,) = transformer_stage_states(sizes, 1, kfac, tensor_parallel=2)
    (shard1,) = transformer_stage_states(sizes, 1, kfac, tensor_parallel=2, index=1)
    embeddings = v * h + p * h + 2 * h + 2 * h
    heads = (
        (h * h + h) * 2 + 2 * h + v + (2 * h + 2)
    )  # pooler, transform + its LayerNorm, decoder bias (tied weight), NSP
    block = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    assert one.numel == embeddings + 2 * block + heads
    # at T = 2: q, k, v 4 x 8 (+ 4 bias), attention output 8 x 4 (+ 8 bias on shard 0), FFN in 8 x 8 (+ 8), FFN out 8 x 8 (+ 8 on shard 0)
    block0 = 3 * (4 * 8 + 4) + (8 * 4 + 8) + (8 * 8 + 8) + (8 * 8 + 8) + 4 * h
    assert shard0.numel == embeddings + 2 * block0 + heads
    assert shard1.numel == shard0.numel - 2 * (8 + 8)
    a_b = [(9, 4)] * 3 + [(5, 8), (9, 8), (9, 8)]  # per block layer: (A, B) factor sizes on shard 0
    a_b_heads = [(9, 8), (9, 8), (9, 2)]  # pooler, transform, NSP: whole
    assert [(layer.a_size, layer.b_size) for layer in shard0.curvature_layers] == a_b * 2 + a_b_heads
    factors = sum(2 * (n * n * 4 + FLAG_BYTES) + COUNTER_BYTES for pair in a_b * 2 + a_b_heads for n in pair)
    topology = Topology(get_schedule("1f1b", 1, 1), 1)
    (rank,) = rank_memory(
        topology, [shard0], optimizer_state("kfac", 0.9, first_order="adamw", memory=methods()["kfac"].memory)
    )
    first_order = embeddings + 4 * h * 2 + 2 * h + v  # LayerNorms of the blocks and the transform, decoder bias
    preconditioned = shard0.numel - first_order
    assert (rank.parameter_bytes, rank.gradient_bytes) == (4 * shard0.numel, 4 * shard0.numel)
    assert rank.curvature_bytes == factors
    tensors = 3 + 2 + 2 * 4 + 2 + 1  # embeddings, their LayerNorm, blocks' and transform's LayerNorms, decoder bias
    assert rank.optimizer_bytes == 4 * preconditioned + 8 * first_order + 4 * tensors


def test_the_stage_states_follow_the_model_into_stages():
    sizes = TransformerSizes(blocks=4, hidden=8, ffn=16, vocab=10, max_positions=6)
    (whole,) = transformer_stage_states(sizes, 1, kfac, tensor_parallel=2)
    stages = transformer_stage_states(sizes, 2, kfac, tensor_parallel=2)
    assert sum(stage.numel for stage in stages) == whole.numel + 10 * 8  # the decoder's own copy of the tied weight
    assert sum(len(stage.curvature_layers) for stage in stages) == len(whole.curvature_layers) == 4 * 6 + 3
    with pytest.raises(ValueError, match="num_stages: 3 does not divide"):
        transformer_stage_states(sizes, 3)


def _table_module():
    spec = importlib.util.spec_from_file_location("tp_table", ROOT / "experiments" / "tp_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_table_follows_from_the_models():
    table = _table_module()
    c = table.EIGEN_FLOPS_PER_CUBE
    for degree in (1, 2, 4):
        row = table.kfac_row(degree)
        d, f = 1024, 4096
        shards = [(d + 1, d // degree)] * 3 + [(d // degree + 1, d), (d + 1, f // degree), (f // degree + 1, d)]
        assert row.inverse_flops == 24 * c * sum(a**3 + b**3 for a, b in shards)
        assert row.precondition_flops == 24 * sum(2 * a * b * (a + b) for a, b in shards)
        assert row.state_bytes == 24 * sum(KfacLayer("", a, b).state_bytes() for a, b in shards)
        shampoo = table.shampoo_row(degree, block_size=f)  # one block per factor: d x d shards' roots cost (d/T)³ + d³
        weights = [(d // degree, d)] * 3 + [(d, d // degree), (f // degree, d), (d, f // degree)]
        assert shampoo.root_flops == 24 * c * sum(r**3 + k**3 for r, k in weights)
        assert shampoo.state_bytes == 24 * 12 * sum(r * r + k * k for r, k in weights)
    blocked = table.shampoo_row(2)  # 1024-blocks: a 2048 x 1024 FFN-in shard is 2 blocks of 1024 x 1024
    assert blocked.root_flops == 24 * c * (3 * (512**3 + d**3) + (d**3 + 512**3) + 2 * 2 * d**3 + 2 * 2 * d**3)
    assert table.kfac_row(1).modelled_ms == pytest.approx(24 * (126.70085430145264 + 14.734029769897461))
