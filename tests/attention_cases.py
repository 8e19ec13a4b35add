"""Masks shared by the fused-attention tests (splash, flex): segment ids of padded or packed
rows, and a structure's mask written out with tfm.nn.attention's functions."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from tfm.kernels.call import AttentionStructure
from tfm.nn import attention as reference
from tfm.nn import positions


def segments(kind: str, batch: int, length: int) -> np.ndarray | None:
    """None, padding (1 real / 0 padded, different lengths per row) or packed ids (0 = pad)."""
    if kind == "none":
        return None
    ids = np.zeros((batch, length), np.int32)
    if kind == "padding":
        for row in range(batch):
            ids[row, : length - 17 * (row + 1)] = 1
        return ids
    cuts = sorted(np.random.default_rng(length).choice(np.arange(5, length - 5), 3, False))
    for row in range(batch):
        ids[row, : cuts[0]], ids[row, cuts[0]: cuts[1]], ids[row, cuts[1]: cuts[2]] = 1, 2, 3
    return ids


def dense_mask(
    structure: AttentionStructure, q_len: int, kv_len: int
) -> jax.Array:  # [batch | 1, 1, q_len, kv_len]
    """The same mask written out with tfm.nn.attention's mask functions."""
    q_index = jnp.arange(q_len)[None]
    kv_index = jnp.arange(kv_len)[None]
    masks = []
    if structure.causal:
        masks.append(reference.causal_mask(q_index, kv_index))
    if structure.window is not None:
        masks.append(reference.local_window_mask(q_index, kv_index, structure.window))
    if structure.query_segments is not None:
        masks.append(reference.segment_mask(structure.query_segments, structure.key_segments))
    return reference.combine_masks(*masks)


def assert_model_matches_reference(backend: str, mode: str, config_for) -> list[str]:
    """Logits at real tokens and every parameter gradient of `backend` equal the reference's:
    mode "lm" a packed decoder-only row pair, "seq2seq" an encoder-decoder with padded source
    and target rows. config_for(backend) -> the ModelConfig. Returns the gradients' paths."""
    from tfm.nn import models

    rng = np.random.default_rng(3)
    length = 140
    vocab = config_for("reference").vocab_size
    tokens = jnp.asarray(rng.integers(1, vocab, (2, length)), jnp.int32)
    if mode == "lm":
        segment_ids = jnp.asarray(segments("packed", 2, length))
        real = np.asarray(segment_ids) > 0
        model_for = lambda backend: models.DecoderLM(config_for(backend))
        apply = lambda model, params: model.apply(params, tokens, segment_ids=segment_ids)
        init_args = (tokens,)
    else:
        source_valid = jnp.asarray(segments("padding", 2, length + 20)) > 0
        source = jnp.asarray(rng.integers(1, vocab, (2, length + 20)), jnp.int32)
        valid = jnp.asarray(segments("padding", 2, length)) > 0
        real = np.asarray(valid)
        model_for = lambda backend: models.EncoderDecoder(config_for(backend))
        apply = lambda model, params: model.apply(params, source, tokens, source_valid=source_valid,
                                                  valid=valid)
        init_args = (source, tokens)
    params = {"params": model_for("reference").init(jax.random.key(0), *init_args)["params"]}
    weights = jnp.asarray(real, jnp.float32)[..., None]

    def loss(params, backend):
        logits = apply(model_for(backend), params)
        logits = logits[0] if isinstance(logits, tuple) else logits
        return jnp.sum(jnp.sin(logits) * weights), logits

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (want, want_logits), want_grads = grad(params, "reference")
    (got, got_logits), got_grads = grad(params, backend)
    np.testing.assert_allclose(np.asarray(got_logits)[real], np.asarray(want_logits)[real],
                               atol=2e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    paths = []
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                            jax.tree.leaves(want_grads), strict=True):
        paths.append(jax.tree_util.keystr(path))
        # float32 sums in another order: the error scales with the leaf's largest entries (an
        # embedding gradient of entries ~80 has near-cancelled ones of ~0.4 off by ~1e-4).
        scale = float(np.max(np.abs(np.asarray(w))))
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=max(5e-5, 2e-6 * scale),
                                   err_msg=paths[-1])
    return paths


def assert_cached_decoding_matches_full_pass(config) -> None:
    """A decoder-only model of `config`: a 12-token prefill then 8 one-token steps through the
    KV cache give the logits of one full pass over the 20 tokens; both with a cache of 32
    slots (the prefill reads the cache) and with one of 12 that the prefill fills (it attends
    to its own keys as a full pass does, tfm.nn.context.cached_inputs), grown by 20 after."""
    from tfm.nn import models
    from tfm.nn.cache import grow, init_cache

    model = models.DecoderLM(config)
    tokens = jnp.asarray(np.random.default_rng(4).integers(1, 13, (2, 20)), jnp.int32)
    params = {"params": model.init(jax.random.key(0), tokens)["params"]}
    full = model.apply(params, tokens)
    for slots in (32, 12):
        logits, cache = model.apply(params, tokens[:, :12], cache=init_cache(config, 2, slots))
        cache = grow(cache, 32 - slots) if slots < 32 else cache
        steps = [logits]
        for index in range(12, 20):
            logits, cache = model.apply(params, tokens[:, index: index + 1], cache=cache)
            steps.append(logits)
        np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5,
                                   err_msg=f"a cache of {slots} slots")


def random_inputs(rng: np.random.Generator, q_len: int, kv_len: int, heads: int, kv_heads: int,
                  dtype: str, batch: int = 2, head_dim: int = 16) -> tuple[jax.Array, ...]:
    """query [batch, q_len, heads, head_dim], key and value [batch, kv_len, kv_heads, head_dim]."""
    query = jnp.asarray(rng.normal(size=(batch, q_len, heads, head_dim)), dtype)
    key, value = (jnp.asarray(rng.normal(size=(batch, kv_len, kv_heads, head_dim)), dtype)
                  for _ in "kv")
    return query, key, value


def case_segments(kind: str, batch: int, q_len: int, kv_len: int):
    """(query segments, key segments) of a case: "cross" = every query real against padded
    keys; else `segments(kind)` shared by queries and keys (None for "none")."""
    if kind == "cross":
        return jnp.ones((batch, q_len), jnp.int32), jnp.asarray(segments("padding", batch, kv_len))
    ids = segments(kind, batch, q_len)
    ids = None if ids is None else jnp.asarray(ids)
    return ids, ids


def lowered_prefill(config, length: int, slots: int, platform: str) -> str:
    """A decoder-only model of `config` prefilling [2, length] tokens into a KV cache of
    `slots` slots, lowered for `platform` (no device or plugin needed), as text."""
    from tfm.nn import models
    from tfm.nn.cache import init_cache

    model = models.DecoderLM(config)
    tokens = jax.ShapeDtypeStruct((2, length), jnp.int32)
    params = jax.eval_shape(
        lambda: {"params": model.init(jax.random.key(0), jnp.ones((2, length), int))["params"]})
    cache = jax.eval_shape(lambda: init_cache(config, 2, slots))
    prefill = lambda params, tokens, cache: model.apply(params, tokens, cache=cache)
    traced = jax.jit(prefill).trace(params, tokens, cache)
    return traced.lower(lowering_platforms=(platform,)).as_text()


def kernel_operands(program: str, kernel: str) -> set[str]:
    """The bfloat16 tensor types every call of `kernel` (its custom call's name) in a lowered
    program reads."""
    calls = [line for line in program.splitlines() if kernel in line]
    assert calls
    return {operand for line in calls
            for operand in re.findall(r"tensor<[0-9x]+bf16>", line.split(") -> (")[0])}


def lowered_lm_grad(config, length: int, platform: str) -> str:
    """The train gradient of a decoder-only model of `config` over [2, length] tokens, lowered
    for `platform` (no device or plugin needed), as text."""
    from tfm.nn import models

    return _lowered_grad(models.DecoderLM(config), 1, length, platform)


def lowered_seq2seq_grad(config, length: int, platform: str) -> str:
    """`lowered_lm_grad` of an encoder-decoder: [2, length] source and decoder tokens."""
    from tfm.nn import models

    return _lowered_grad(models.EncoderDecoder(config), 2, length, platform)


def _lowered_grad(model, num_inputs: int, length: int, platform: str) -> str:
    """The gradient of the sum of `model`'s logits over `num_inputs` [2, length] token arrays,
    lowered for `platform`, as text."""
    tokens = [jax.ShapeDtypeStruct((2, length), jnp.int32)] * num_inputs
    params = jax.eval_shape(lambda: {"params": model.init(
        jax.random.key(0), *[jnp.ones((2, length), int)] * num_inputs)["params"]})
    loss = lambda params, tokens: jnp.sum(model.apply(params, *tokens))
    traced = jax.jit(jax.grad(loss)).trace(params, tokens)
    return traced.lower(lowering_platforms=(platform,)).as_text()


def block_bias(kind: str, heads: int, causal: bool, rng: np.random.Generator):
    """(block bias function, parameters [heads, P]) of a T5 table or learned ALiBi slopes."""
    if kind == "t5":
        function = functools.partial(positions.t5_block_bias, bidirectional=not causal,
                                     num_buckets=16, max_distance=64)
        return function, (jnp.asarray(rng.normal(size=(heads, 16)), jnp.float32),)
    slopes = positions.alibi_slopes(heads) * rng.uniform(0.5, 2.0, heads)
    return positions.alibi_block_bias, (jnp.asarray(slopes, jnp.float32)[:, None],)
