"""tfm.training.collectives: each collective's result bytes per kind, a loop's counted once per
iteration; under context parallelism the ring moves K/V by collective-permute and all_gather
by all-gather, by as many bytes as their shapes say."""

from __future__ import annotations

import pytest

from configs import synthetic_lm
from tfm.training import collectives, compile_report

PROGRAM = """\
%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %sent = f32[4,8]{1,0} collective-permute(%x), metadata={op_name="layer_0/self_attention/ppermute"}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %sent)
}

ENTRY %main (a: f32[2,8]) -> f32[8,8] {
  %a = f32[2,8]{1,0} parameter(0)
  %g = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%a), metadata={op_name="mlp"}
  %d = f32[8,8]{1,0} all-gather-done(%g)
  %w = (s32[], f32[4,8]{1,0}) while(%i), body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[8,8]{1,0} all-reduce(%d), to_apply=%add
}
"""


def test_result_bytes_per_kind_with_loops_counted_per_iteration():
    found = collectives.collective_bytes(PROGRAM)
    assert found["bytes"] == {"all-gather": 4 * 8 * 8, "collective-permute": 3 * 4 * 4 * 8,
                              "all-reduce": 4 * 8 * 8}
    assert found["attention"] == {"collective-permute": 3 * 4 * 4 * 8}
    assert found["count"] == {"all-gather": 1, "collective-permute": 3, "all-reduce": 1}
    assert found["largest"] == [["collective-permute", "layer_*/self_attention/ppermute", 384],
                                ["all-gather", "mlp", 256], ["all-reduce", "all-reduce", 256]]
    text = collectives.format_collectives(found)
    assert "collective-permute 0.000 GB (attention 0.000 GB)" in text
    assert "collective-permute layer_*/self_attention/ppermute" in text


def _config(data_dir, strategy: str):
    config = synthetic_lm.get_config("runlocal")
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=2,
                        position_scheme="t5_bias", context_parallel=strategy)
    config.data.update(data_dir=str(data_dir), batch_size=2, seq_len=32, num_train_examples=16,
                       num_eval_examples=4)
    config.mesh.update(data=2, context=4)
    return config


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_attention_moves_what_its_shapes_say(tmp_path, strategy):
    report = compile_report.train_report(_config(tmp_path, strategy), tmp_path, "cpu")
    moved = report["collectives"]["attention"]
    layers, context, rows, length, kv_heads, head_dim = 2, 4, 1, 32, 2, 16  # rows per device
    chunk = length // context
    # Keys and values (float32), and three int32 rows that travel with them: the keys'
    # original indices, segment ids and positions (T5's bias is made from them).
    def keys_values(tokens: int) -> int:
        return 2 * rows * tokens * kv_heads * head_dim * 4

    def ints(tokens: int) -> int:
        return 3 * rows * tokens * 4

    kv_grads = 2 * rows * chunk * kv_heads * head_dim * 4
    if strategy == "all_gather":  # gathered whole (the int rows are every layer's: once);
        assert moved.get("collective-permute", 0) == 0  # dK, dV scattered back
        assert moved["all-gather"] == layers * keys_values(length) + ints(length)
        assert moved["reduce-scatter"] == layers * kv_grads
    else:  # N - 1 steps forward; N - 1 backward with dK, dV, then dK, dV home
        assert moved.get("all-gather", 0) == 0
        block = keys_values(chunk) + ints(chunk)
        assert moved["collective-permute"] == layers * (
            (context - 1) * block + (context - 1) * (block + kv_grads) + kv_grads)
