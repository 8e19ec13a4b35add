"""tfm.training.hlo_breakdown: each instruction's bytes and FLOPs from compiled HLO text, summed
against XLA's own cost analysis, and grouped by the part of the model that made it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tfm.training import hlo_breakdown


def _compiled(function, *arguments):
    return jax.jit(function).lower(*arguments).compile()


def _xla(compiled):
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, list | tuple) else cost


def test_array_bytes_reads_every_array_of_a_shape():
    assert hlo_breakdown.array_bytes("f32[8,128]{1,0:T(8,128)}") == 4 * 8 * 128
    assert hlo_breakdown.array_bytes("(bf16[4,2]{1,0}, s32[], pred[3])") == 16 + 4 + 3


def test_matmuls_sum_to_xla_bytes_and_flops():
    """Straight-line matmuls and their gradients: every byte XLA counts, and its FLOPs less
    the elementwise ones."""

    def loss(x, w1, w2):
        with jax.named_scope("feed_forward"):
            h = jnp.tanh(x @ w1)
        return jnp.sum(h @ w2)

    compiled = _compiled(jax.grad(loss, argnums=(1, 2)), jnp.ones((64, 128)),
                         jnp.ones((128, 256)), jnp.ones((256, 32)))
    result = hlo_breakdown.breakdown(compiled.as_text())
    assert result["total_bytes"] == pytest.approx(_xla(compiled)["bytes accessed"], rel=0.01)
    matmuls = 2 * 2 * 64 * 128 * 256 + 3 * 2 * 64 * 256 * 32  # forward, then weight grads
    assert result["total_flops"] == pytest.approx(matmuls, rel=0.25)
    assert result["total_flops"] <= _xla(compiled)["flops"]
    assert result["groups"]["ffn"]["bytes"] > 0  # named by the scope


def test_a_loop_body_counts_once_and_slices_count_what_they_touch():
    """A fori_loop whose gradient saves each iteration into a stacked buffer: XLA counts the
    body once, the in-place row update and the row read as one row, not the whole stack."""

    def loss(x):
        return jax.lax.fori_loop(0, 4, lambda i, h: h * 1.5 + jnp.sin(h), x).sum()

    compiled = _compiled(jax.grad(loss), jnp.ones((64, 256)))
    whole = hlo_breakdown.breakdown(compiled.as_text())["total_bytes"]
    assert whole == pytest.approx(_xla(compiled)["bytes accessed"], rel=0.02)


def test_groups_follow_the_name_stack_and_collectives_the_opcode():
    assert hlo_breakdown.classify("fusion", "jit(step)/jvp(M)/layer_3/self_attention/dot") \
        == "attention"
    assert hlo_breakdown.classify("fusion", "jit(step)/M/layer_0/feed_forward/wo/dot") == "ffn"
    assert hlo_breakdown.classify("fusion", "jit(step)/optimizer/mul") == "optimizer"
    assert hlo_breakdown.classify("all-gather-start", "jit(step)/M/feed_forward") \
        == "collectives"
    assert hlo_breakdown.classify("fusion", "jit(step)/M/final_norm/layer_norm") == "norm"
    assert hlo_breakdown.classify(  # the norm before the FFN is a norm, not the FFN
        "fusion", "jit(step)/transpose(jvp(M))/layer_2/feed_forward_norm/layer_norm/mul") == "norm"
    assert hlo_breakdown.classify("fusion", "jit(step)/M/decoder/embed/gather") \
        == "embedding/loss"


def test_a_dot_written_as_a_padded_convolution_counts_its_real_taps():
    """TPU writes the [B, T, D] x [D, N, H] projection as a convolution whose 12-tap window
    slides over a padded length-1 axis: one tap in twelve touches the input."""
    program = """HloModule m
ENTRY %main (a: bf16[8,1024,768,1], b: bf16[768,12,64,1]) -> f32[8,1024,12,64] {
  %a = bf16[8,1024,768,1]{3,2,1,0} parameter(0)
  %b = bf16[768,12,64,1]{3,2,1,0} parameter(1)
  ROOT %c = f32[8,1024,12,64]{3,2,1,0} convolution(%a, %b), WINDOW, dim_labels=0bf1_i1o0->0b1f
}
""".replace("WINDOW", "window={size=1x12 pad=0_0x11_11 rhs_reversal=0x1}")
    (cost,) = hlo_breakdown.instruction_costs(program)
    assert cost.flops == 2 * 8 * 1024 * 12 * 64 * 768
    assert cost.bytes == 2 * (8 * 1024 * 768 + 768 * 12 * 64) + 4 * 8 * 1024 * 12 * 64
