"""tfm.nn.attention (the reference) and tfm.kernels.attention's backends against naive numpy,
across dtypes, masks and error cases; the CPU kernel's blocks, cache layout and 16-bit backward."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm import kernels
from tfm.kernels import cache_layouts, cpu_attention, cpu_compile
from tfm.nn import attention

BATCH, Q_LEN, KV_LEN, NUM_HEADS, HEAD_DIM = 2, 5, 6, 4, 8

# One compilation per configuration is much cheaper than op-by-op dispatch on a busy CPU.
attend = jax.jit(kernels.attention, static_argnames=(
    "scale", "backend", "return_weights", "dropout_rate", "causal", "cache_layout"))


def _qkv(num_kv_heads, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(BATCH, Q_LEN, NUM_HEADS, HEAD_DIM))
    key = rng.normal(size=(BATCH, KV_LEN, num_kv_heads, HEAD_DIM))
    value = rng.normal(size=(BATCH, KV_LEN, num_kv_heads, HEAD_DIM))
    return [jnp.asarray(x, dtype) for x in (query, key, value)]


def _random_mask(seed=1):
    mask = np.random.default_rng(seed).random((BATCH, 1, Q_LEN, KV_LEN)) < 0.6
    mask[..., 0] = True  # every row attends somewhere (fully masked rows have their own test)
    return jnp.asarray(mask)


def _random_bias(seed=2):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(1, NUM_HEADS, Q_LEN, KV_LEN)),
                       jnp.float32)


def _naive(query, key, value, bias, mask):
    """Loops over batch and heads, float64 numpy softmax."""
    query, key, value = (np.asarray(x, np.float64) for x in (query, key, value))
    batch, q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    bias = np.broadcast_to(np.zeros(1) if bias is None else np.asarray(bias),
                           (batch, num_heads, q_len, kv_len))
    mask = np.broadcast_to(True if mask is None else np.asarray(mask),
                           (batch, num_heads, q_len, kv_len))
    out = np.zeros_like(query)
    weights = np.zeros((batch, num_heads, q_len, kv_len))
    for b in range(batch):
        for n in range(num_heads):
            kv = n // (num_heads // num_kv_heads)
            logits = query[b, :, n] @ key[b, :, kv].T / np.sqrt(head_dim) + bias[b, n]
            logits = np.where(mask[b, n], logits, -1e30)
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            weights[b, n] = probs
            out[b, :, n] = probs @ value[b, :, kv]
    return out, weights


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_reference_matches_naive_numpy(num_kv_heads, backend):
    query, key, value = _qkv(num_kv_heads)
    bias, mask = _random_bias(), _random_mask()
    out, weights = attend(
        query, key, value, bias=bias, mask=mask, return_weights=True, backend=backend)
    expected_out, expected_weights = _naive(query, key, value, bias, mask)
    assert out.shape == query.shape and out.dtype == jnp.float32
    assert weights.shape == (BATCH, NUM_HEADS, Q_LEN, KV_LEN) and weights.dtype == jnp.float32
    np.testing.assert_allclose(out, expected_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(weights, expected_weights, atol=1e-6)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    full_mask = np.broadcast_to(np.asarray(mask), weights.shape)
    assert np.all(np.asarray(weights)[~full_mask] == 0.0)


def test_explicit_scale_and_no_mask():
    query, key, value = _qkv(2)
    out = attend(query, key, value, scale=0.3)
    # scale s on the logits equals scaling the query by s * sqrt(head_dim) under the default scale.
    expected, _ = _naive(query * 0.3 * np.sqrt(HEAD_DIM), key, value, None, None)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "num_kv_heads,use_bias,use_mask",
    [(4, False, True), (4, True, False), (2, True, True), (1, False, True)],
    ids=["mask", "bias", "gqa-bias-mask", "mqa-mask"],
)
def test_reference_matches_the_kernels(num_kv_heads, use_bias, use_mask):
    query, key, value = _qkv(num_kv_heads, seed=3)
    kwargs = dict(bias=_random_bias() if use_bias else None,
                  mask=_random_mask() if use_mask else None)
    reference = attend(query, key, value, backend="reference", **kwargs)
    for backend in ("cpu", "xla"):
        out = attend(query, key, value, backend=backend, **kwargs)
        np.testing.assert_allclose(out, reference, atol=1e-5, rtol=1e-5, err_msg=backend)


def test_padding_mask_broadcast_over_queries_matches_xla():
    query, key, value = _qkv(2, seed=4)
    mask = attention.padding_mask(attention.valid_from_lengths(jnp.array([3, 6]), KV_LEN))
    assert mask.shape == (BATCH, 1, 1, KV_LEN)
    reference = attend(query, key, value, mask=mask)
    xla = attend(query, key, value, mask=mask, backend="xla")
    np.testing.assert_allclose(reference, xla, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(reference, _naive(query, key, value, None, mask)[0], atol=1e-5)


def test_bf16_output_dtype_and_close_to_f32():
    query, key, value = _qkv(2, seed=5)
    mask = _random_mask()
    out32 = attend(query, key, value, mask=mask)
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (query, key, value))
    out16, weights16 = attend(
        q16, k16, v16, mask=mask, return_weights=True)
    assert out16.dtype == jnp.bfloat16 and weights16.dtype == jnp.float32
    np.testing.assert_allclose(out16.astype(jnp.float32), out32, atol=5e-2, rtol=5e-2)
    xla16 = attend(q16, k16, v16, mask=mask, backend="xla")
    assert xla16.dtype == jnp.bfloat16
    np.testing.assert_allclose(xla16.astype(jnp.float32), out32, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("backend", ["reference", "cpu", "xla"])
def test_bf16_softmax_runs_in_float32(backend):
    # Logits 256 and 257: in bf16 (spacing 2 near 256) they would round equal and give 0.5 / 0.5,
    # so this fails unless both the logits and the softmax are kept in float32.
    query = jnp.full((1, 1, 1, 8), 16.0, jnp.bfloat16)
    key = jnp.full((1, 2, 1, 8), 2.0, jnp.bfloat16).at[0, 1, 0, 0].add(1 / 16)  # exact in bf16
    value = jnp.asarray([0.0, 1.0], jnp.bfloat16).reshape(1, 2, 1, 1) * jnp.ones(8, jnp.bfloat16)
    out = attend(query, key, value, scale=1.0, backend=backend)
    expected = 1.0 / (1.0 + np.exp(-1.0))  # sigmoid(1) = 0.731 is the weight on value 1
    np.testing.assert_allclose(out.astype(jnp.float32), expected, atol=4e-3)


def test_fully_masked_rows_read_nothing():
    """A query whose keys are all masked outputs zeros and passes no gradient to any key: a
    uniform average would read masked (e.g. future or left-padding) keys."""
    query, key, value = _qkv(2, seed=6)
    mask = np.ones((BATCH, 1, Q_LEN, KV_LEN), bool)
    mask[0, 0, 2] = False
    mask = jnp.asarray(mask)
    bias = _random_bias()
    for backend in ("reference", "cpu", "xla"):
        out = attend(query, key, value, bias=bias, mask=mask, backend=backend)
        np.testing.assert_array_equal(out[0, 2], 0.0, err_msg=backend)
        assert float(jnp.abs(out[0, 1]).max()) > 0, backend  # other rows still attend

        def row_sum(key, value, backend=backend):
            out = kernels.attention(
                query, key, value, bias=bias, mask=mask, backend=backend
            )
            return out[0, 2].sum()

        grads = jax.grad(row_sum, argnums=(0, 1))(key, value)
        for grad in grads:
            np.testing.assert_array_equal(grad, 0.0, err_msg=backend)


def test_dropout():
    query, key, value = _qkv(2, seed=7)
    # rbg keys: threefry's bernoulli alone takes ~5 s to compile on this CPU; any key type works.
    rng = jax.random.key(0, impl="rbg")
    plain, plain_weights = attend(query, key, value, return_weights=True)
    zero_rate = attend(query, key, value, dropout_rate=0.0,
                                                dropout_rng=rng)
    np.testing.assert_array_equal(zero_rate, plain)

    def run(key_rng):
        return attend(query, key, value, dropout_rate=0.5,
                                               dropout_rng=key_rng, return_weights=True)

    out_a, weights_a = run(rng)
    out_b, weights_b = run(rng)
    np.testing.assert_array_equal(out_a, out_b)
    np.testing.assert_array_equal(weights_a, weights_b)
    _, weights_c = run(jax.random.key(1, impl="rbg"))
    assert not np.array_equal(weights_a, weights_c)
    kept = np.asarray(weights_a) != 0
    assert 0.2 < kept.mean() < 0.8
    np.testing.assert_allclose(np.asarray(weights_a)[kept], 2.0 * np.asarray(plain_weights)[kept],
                               rtol=1e-6)
    # The output uses exactly the dropped-out weights.
    expected = np.einsum("bkgts,bskh->btkgh",
                         np.asarray(weights_a).reshape(BATCH, 2, 2, Q_LEN, KV_LEN), value)
    np.testing.assert_allclose(out_a, expected.reshape(query.shape), atol=1e-5)


def test_causal_mask_with_per_row_offsets():
    # KV-cache decoding: row 0 is at position 2, row 1 at position 4, cache slots 0..5.
    mask = attention.causal_mask(jnp.array([[2], [4]]), jnp.tile(jnp.arange(6), (2, 1)))
    expected = np.array([[[[1, 1, 1, 0, 0, 0]]], [[[1, 1, 1, 1, 1, 0]]]], bool)
    assert mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask, expected)
    # Prefill with positions 0..2 equals the lower triangle.
    positions = jnp.arange(3)[None]
    np.testing.assert_array_equal(attention.causal_mask(positions, positions)[0, 0],
                                  np.tril(np.ones((3, 3), bool)))


def test_padding_masks_from_lengths_and_ids():
    valid = attention.valid_from_lengths(jnp.array([2, 3]), 4)
    np.testing.assert_array_equal(valid, [[1, 1, 0, 0], [1, 1, 1, 0]])
    np.testing.assert_array_equal(attention.valid_from_ids(jnp.array([[5, 3, 0, 0]])),
                                  [[1, 1, 0, 0]])
    np.testing.assert_array_equal(attention.valid_from_ids(jnp.array([[5, 3, 9]]), pad_id=3),
                                  [[1, 0, 1]])
    key_only = attention.padding_mask(valid)
    np.testing.assert_array_equal(key_only, np.asarray(valid)[:, None, None, :])
    query_valid = jnp.array([[1, 0, 1], [1, 1, 0]], bool)
    both = attention.padding_mask(valid, query_valid)
    np.testing.assert_array_equal(both[0, 0], [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(both[1, 0], [[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]])


def test_segment_and_local_window_masks():
    segments = jnp.array([[1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(attention.segment_mask(segments, segments)[0, 0], [
        [1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ])
    positions = jnp.arange(5)[None]
    np.testing.assert_array_equal(attention.local_window_mask(positions, positions, 1)[0, 0], [
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1],
    ])
    np.testing.assert_array_equal(attention.local_window_mask(positions, positions, 0)[0, 0],
                                  np.eye(5, dtype=bool))
    # Query at position 7 against keys 4..9, radius 2: keys 5..9.
    np.testing.assert_array_equal(
        attention.local_window_mask(jnp.array([[7]]), jnp.arange(4, 10)[None], 2)[0, 0],
        [[0, 1, 1, 1, 1, 1]])


def test_combined_mask_for_packed_rows():
    # Two packed examples (positions restart) then one pad: causal AND same segment AND valid keys.
    positions = jnp.array([[0, 1, 2, 0, 1, 0]])
    segments = jnp.array([[1, 1, 1, 2, 2, 0]])
    mask = attention.combine_masks(
        attention.causal_mask(positions, positions),
        None,
        attention.segment_mask(segments, segments),
        attention.padding_mask(attention.valid_from_ids(segments)),
    )
    np.testing.assert_array_equal(mask[0, 0], [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0],
    ])
    assert attention.combine_masks(None, None) is None
    single = attention.padding_mask(jnp.array([[True, False]]))
    np.testing.assert_array_equal(attention.combine_masks(None, single), single)


def _call(**kwargs):
    num_kv_heads = kwargs.pop("num_kv_heads", 2)
    query, key, value = _qkv(num_kv_heads)
    dtype = kwargs.pop("dtype", jnp.float32)
    return kernels.attention(
        query.astype(dtype), key.astype(dtype), value.astype(dtype), **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param(dict(backend="cudnn", dtype=jnp.bfloat16),
                     "attention_backend='cudnn' needs a GPU",
                     marks=pytest.mark.skipif(jax.default_backend() == "gpu", reason="has a GPU")),
        (dict(backend="cudnn"), "cudnn' needs bfloat16 or float16"),
        (dict(backend="cudnn", dtype=jnp.bfloat16, bias=jnp.zeros((1, 1, 1, KV_LEN))),
         r"cudnn' needs bias of shape .*\(1, 1, 1, 6\)"),
        (dict(backend="xla", return_weights=True),
         "attention_backend='xla' cannot return attention weights.*'reference'"),
        (dict(backend="xla", dropout_rate=0.1, dropout_rng=jax.random.key(0)),
         "attention_backend='xla' has no attention dropout.*'reference'"),
        (dict(backend="flash"),
         "attention_backend='flash' is unknown; .*auto, reference, cpu, xla, cudnn"),
        (dict(mask=jnp.ones((Q_LEN, KV_LEN), bool)), r"mask has shape \(5, 6\); expected rank 4"),
        (dict(mask=jnp.ones((BATCH, 1, Q_LEN, 3), bool)),
         r"mask has shape \(2, 1, 5, 3\).*\[2, 4, 5, 6\]"),
        (dict(bias=jnp.zeros((1, 3, Q_LEN, KV_LEN))), r"bias has shape \(1, 3, 5, 6\)"),
        (dict(mask=jnp.ones((BATCH, 1, Q_LEN, KV_LEN))), "mask must be bool"),
        (dict(num_kv_heads=3), "num_heads=4 must be a multiple of num_kv_heads=3"),
        (dict(dropout_rate=0.1), "needs a dropout_rng"),
    ],
    ids=["cudnn-cpu", "cudnn-f32", "cudnn-bias", "xla-weights", "xla-dropout", "unknown",
         "mask-rank", "mask-shape", "bias-shape", "mask-dtype", "heads", "dropout-rng"],
)
def test_errors_are_readable(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _call(**kwargs)


def test_shape_errors():
    query, key, value = _qkv(2)
    with pytest.raises(ValueError, match="query must be rank 4"):
        attention.dot_product_attention(query[0], key, value)
    with pytest.raises(ValueError, match="key and value shapes must match"):
        attention.dot_product_attention(query, key, value[:, :3])
    with pytest.raises(ValueError, match="must share batch and head_dim"):
        attention.dot_product_attention(query[..., :4], key, value)


def _causal_padded_gqa(length, dtype, seed):
    """query [2, length, 4, 8], key and value [2, length, 2, 8] in dtype, a causal mask with the
    second row's last 40 keys padded, and a float32 bias [1, 4, length, length]."""
    rng = np.random.default_rng(seed)
    query = jnp.asarray(rng.normal(size=(2, length, 4, 8)), dtype)
    key, value = (jnp.asarray(rng.normal(size=(2, length, 2, 8)), dtype) for _ in "kv")
    positions = jnp.broadcast_to(jnp.arange(length), (2, length))
    valid = jnp.arange(length)[None, :] < jnp.array([[length], [length - 40]])
    mask = attention.combine_masks(attention.causal_mask(positions, positions),
                                   attention.padding_mask(valid))
    bias = jnp.asarray(rng.normal(size=(1, 4, length, length)), jnp.float32)
    return query, key, value, mask, bias


def test_causal_block_skipping_equals_the_full_computation():
    """causal=True skips key blocks after each query block (q_len >= 2 * CAUSAL_BLOCK): values
    and gradients equal the unblocked computation, with a bias, GQA and padded keys."""
    length = 2 * cpu_attention.CAUSAL_BLOCK + 17  # three blocks, the last one partial
    query, key, value, mask, bias = _causal_padded_gqa(length, jnp.float32, seed=11)

    def loss(query, key, value, causal):
        out = kernels.attention(query, key, value, bias=bias, mask=mask, backend="cpu",
                                causal=causal)
        return jnp.sum(out * jnp.cos(out)), out

    (_, blocked), blocked_grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(
        query, key, value, True)
    (_, full), full_grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(
        query, key, value, False)
    assert len(cpu_attention.causal_blocks(length, length)) == 3
    np.testing.assert_allclose(blocked, full, atol=1e-5)
    for got, want in zip(blocked_grads, full_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("length", [100, 128, 145, 512, 513, 1024, 4096])
def test_causal_blocks_cover_the_queries_in_few_blocks(length):
    blocks = cpu_attention.causal_blocks(length, length)
    starts, stops = zip(*blocks, strict=True)
    assert starts[0] == 0 and stops[-1] == length
    assert list(starts[1:]) == list(stops[:-1])  # contiguous, each query once
    assert len(blocks) <= cpu_attention.MAX_CAUSAL_BLOCKS
    if length >= 2 * cpu_attention.CAUSAL_BLOCK:
        assert len(blocks) >= 2
        sizes = {stop - start for start, stop in blocks[:-1]}
        assert len(sizes) == 1 and sizes.pop() % cpu_attention.CAUSAL_BLOCK == 0
    else:
        assert blocks == [(0, length)]
    assert cpu_attention.causal_blocks(length, length + 1) == [(0, length)]  # not self-attention


def test_cache_layout_equals_the_default_layout():
    query, key, value = _qkv(2, seed=12)
    mask, bias = _random_mask(), _random_bias()
    expected = attend(query, key, value, bias=bias, mask=mask)
    for backend in ("cpu", "reference", "xla", "flex"):  # flex: TPU's, on the reference here
        layout = kernels.BACKENDS[backend].cache
        order = lambda is_key, layout=layout: [
            cache_layouts.MODEL_AXES.index(axis) for axis in layout.axes(is_key)]
        out = kernels.attention(
            query, key.transpose(order(True)), value.transpose(order(False)), bias=bias,
            mask=mask, backend=backend, cache_layout=True)
        np.testing.assert_allclose(out, expected, atol=1e-5, err_msg=backend)
    with pytest.raises(ValueError, match="with cache_layout"):
        kernels.attention(query, key, value, backend="cpu", cache_layout=True)


@pytest.mark.parametrize("groups", [1, 2], ids=["mha", "gqa"])
def test_16bit_backward_equals_autodiff(groups):
    """cpu_attention.attend_16bit's hand-written backward pass (run here in float32, where
    nothing is rounded to 16 bits) against jax's autodiff of attend_block over the same query
    blocks: the gradients of queries, keys, values and the bias, with a padding mask that leaves
    one query no key, a bias broadcast over the batch, and dropout (same rngs, same masks)."""
    rng = np.random.default_rng(21)
    batch, kv_heads, q_len, kv_len, head_dim = 2, 2, 5, 7, 8
    blocks = ((0, 3, 4), (3, 5, kv_len))  # queries [start, stop) read keys [0, kv_stop)
    query = jnp.asarray(rng.normal(size=(batch, kv_heads, groups, q_len, head_dim)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(batch, kv_heads, kv_len, head_dim)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(batch, kv_heads, kv_len, head_dim)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(1, kv_heads * groups, q_len, kv_len)), jnp.float32)
    mask = rng.random((batch, 1, q_len, kv_len)) < 0.7
    mask[..., 0] = True
    mask[1, 0, 3] = False  # this query sees no key
    mask = jnp.asarray(mask)
    probe = jnp.asarray(rng.normal(size=query.shape), jnp.float32)
    dropout_rng = jax.random.key(3, impl="rbg")

    def loss(path, query, keys, values, bias, rate):
        if path == "16bit":
            out = cpu_attention.attend_16bit(
                query, keys.swapaxes(-1, -2), values, bias, mask, 0.3, rate, dropout_rng, blocks)
        else:
            out = jnp.concatenate([cpu_attention.attend_block(
                query[:, :, :, start:stop], keys[:, :, :kv_stop], values[:, :, :kv_stop],
                cpu_attention.rows_cols(bias, start, stop, kv_stop),
                cpu_attention.rows_cols(mask, start, stop, kv_stop), 0.3, rate,
                cpu_attention.block_rng(dropout_rng, start), False,
            )[0] for start, stop, kv_stop in blocks], axis=3)
        return jnp.sum(jnp.sin(out) * probe), out

    for rate in (0.0, 0.4):
        grads, outs = {}, {}
        for path in ("16bit", "autodiff"):
            (_, outs[path]), grads[path] = jax.jit(
                jax.value_and_grad(loss, (1, 2, 3, 4), has_aux=True), static_argnums=(0, 5)
            )(path, query, keys, values, bias, rate)
        np.testing.assert_allclose(outs["16bit"], outs["autodiff"], atol=1e-5)
        np.testing.assert_array_equal(outs["16bit"][1, :, :, 3], 0.0)
        for name, got, want in zip("qkvb", grads["16bit"], grads["autodiff"], strict=True):
            assert float(jnp.abs(want).max()) > 0.1, name
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{name}, rate {rate}")


def test_bf16_attention_gradients_are_close_to_float32():
    """The bf16 path (16-bit backward matmuls, causal blocks, GQA, padding, a bias) end to end
    against float32 on the same bf16-exact inputs, to bf16 rounding."""
    length = 2 * cpu_attention.CAUSAL_BLOCK + 9
    query, key, value, mask, bias = _causal_padded_gqa(length, jnp.bfloat16, seed=22)
    probe = jnp.asarray(np.random.default_rng(23).normal(size=query.shape), jnp.float32)

    def loss(query, key, value, bias):
        out = kernels.attention(query, key, value, bias=bias, mask=mask, backend="cpu",
                                causal=True)
        return jnp.sum(out.astype(jnp.float32) * probe)

    grad = jax.jit(jax.grad(loss, (0, 1, 2, 3)))
    got = grad(query, key, value, bias)
    want = grad(*(x.astype(jnp.float32) for x in (query, key, value)), bias)
    for name, g, w in zip("qkvb", got, want, strict=True):
        assert g.dtype == (jnp.float32 if name == "b" else jnp.bfloat16), name
        scale = float(jnp.abs(w).max())
        np.testing.assert_allclose(g.astype(jnp.float32), w, atol=0.02 * scale, err_msg=name)


def test_bf16_attention_backward_matmuls_stay_bfloat16_when_compiled():
    """Every matmul of the bf16 attention core's forward and backward pass compiles with bf16
    operands (autodiff made the backward ones float32 x float32), with the kernels a bf16
    model's train step uses on a CPU with bf16 units (cpu_kernels="ynnpack_dots")."""
    query, key, value = (x.astype(jnp.bfloat16) for x in _qkv(2, seed=23))

    def loss(query, key, value):
        out = kernels.attention(query, key, value, backend="cpu")
        return jnp.sum(out.astype(jnp.float32))

    grad = cpu_compile.jit(jax.grad(loss, (0, 1, 2)), cpu_kernels="ynnpack_dots")
    program = grad.lower(query, key, value).compile().as_text()
    dtypes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", program))
    operands = [tuple(dtypes[name] for name in re.findall(r"%([\w.\-]+)", args))
                for args in re.findall(r" dot\(([^)]*)\)", program)]
    assert len(operands) >= 6, operands  # 2 forward, 4 backward (each may sit in a fusion)
    assert set(operands) == {("bf16", "bf16")}, operands
