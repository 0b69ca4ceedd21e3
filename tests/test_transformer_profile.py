from dataclasses import replace

from pipefisher.planning.transformer_profile import BlockTimes, transformer_profile

TIMES = BlockTimes(time_f=29.2, time_b=49.4, time_kron=7.3, time_inv=16.9, time_prec=1.2)


def test_capture_sizes_are_token_rows_times_width_times_dtype_bytes():
    profile = transformer_profile(TIMES, 12, 4, 768, 3072, micro_batch_size=32)
    layers = {layer.name: layer for stage in profile.stages for layer in stage.layers}
    # 32 sequences x 128 tokens, fp32; A is the input as the engine stores it (no bias column)
    assert (layers["block0.attention.query"].captured(0), layers["block0.attention.query"].captured(1)) == (
        12_582_912,
        12_582_912,
    )
    assert (layers["block3.intermediate"].captured(0), layers["block3.intermediate"].captured(1)) == (
        12_582_912,
        50_331_648,
    )
    assert (layers["block11.output"].captured(0), layers["block11.output"].captured(1)) == (
        50_331_648,
        12_582_912,
    )
    half = transformer_profile(TIMES, 12, 4, 768, 3072, micro_batch_size=2, seq_len=512, capture_dtype_bytes=2)
    assert half.stages[0].layers[0].captured(0) == 2 * 512 * 768 * 2


def test_capture_sizes_leave_times_alone_and_are_unknown_without_a_micro_batch_size():
    unknown = transformer_profile(TIMES, 12, 4, 768, 3072)
    assert all(layer.captured(0) == layer.captured(1) == 0 for stage in unknown.stages for layer in stage.layers)
    known = transformer_profile(TIMES, 12, 4, 768, 3072, micro_batch_size=32)
    without_sizes = tuple(
        replace(stage, layers=tuple(replace(layer, capture_bytes=()) for layer in stage.layers))
        for stage in known.stages
    )
    assert without_sizes == unknown.stages
