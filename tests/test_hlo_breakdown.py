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
    assert hlo_breakdown.classify("fusion", "jit(step)/M/decoder/embed/gather") \
        == "embedding/loss"
