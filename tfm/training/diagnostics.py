"""Training diagnostics (train.diagnostics_every): per-layer parameter, gradient and update norms,
and per-layer, per-head attention entropy and distance on a fixed evaluation batch.

Logged as "diagnostics/<family>/<stack>/layer_<i>[/head_<h>]", e.g.
"diagnostics/attention_entropy/decoder/layer_2/head_5"; families: param_norm, grad_norm,
update_norm, attention_entropy, attention_distance. They run as their own jitted function on the
step's batch before the train step, so the train step (and its loss) is the same with or without
them; steps with diagnostics pay one more forward and backward pass.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from tfm.kernels import cpu_compile
from tfm.nn.families import get_family
from tfm.parallel import sharding
from tfm.training.experiment import Experiment, model_for
from tfm.training.state import InShardingContext, TrainState

Array = jax.Array
_LAYER = re.compile(r"layer_\d+")
# Which batch entries hold the positions and segment ids (0 = padding) of a stack's tokens.
_STACK_KEYS = {"encoder": ("source_positions", "source_segment_ids")}
_DECODER_KEYS = ("positions", "segment_ids")


def _mean_over_real_queries(per_query: Array, query_valid: Array) -> Array:
    """per_query: [batch, heads, q_len]; query_valid: [batch, q_len] bool -> [heads]."""
    valid = query_valid[:, None, :].astype(jnp.float32)
    total = jnp.sum(per_query * valid, axis=(0, 2))
    return total / jnp.maximum(jnp.sum(valid, axis=(0, 2)), 1.0)


def attention_entropy(weights: Array, query_valid: Array) -> Array:
    """Mean over real queries of -sum_k p_k log p_k, per head (nats; log(n) for uniform
    attention over n keys, 0 for attention on one key).

    weights: [batch, heads, q_len, kv_len], rows summing to 1; query_valid: [batch, q_len] bool
    -> [heads]."""
    weights = weights.astype(jnp.float32)
    safe = jnp.where(weights > 0, weights, 1.0)  # 0 log 0 = 0
    per_query = -jnp.sum(weights * jnp.log(safe), axis=-1)
    return _mean_over_real_queries(per_query, query_valid)


def attention_distance(
    weights: Array, query_positions: Array, key_positions: Array, query_valid: Array
) -> Array:
    """Mean over real queries of sum_k p_k |q_pos - k_pos|, per head: how far (in positions) a
    head looks on average.

    weights: [batch, heads, q_len, kv_len]; query_positions, query_valid: [batch, q_len];
    key_positions: [batch, kv_len] -> [heads]."""
    offsets = query_positions[:, :, None] - key_positions[:, None, :]  # [batch, q_len, kv_len]
    distance = jnp.abs(offsets).astype(jnp.float32)[:, None]
    per_query = jnp.sum(weights.astype(jnp.float32) * distance, axis=-1)
    return _mean_over_real_queries(per_query, query_valid)


def _keys(path: tuple) -> list[str]:
    return [str(getattr(entry, "key", getattr(entry, "idx", entry))) for entry in path]


def layer_norms(tree: Any) -> dict[str, Array]:
    """{"<stack>/layer_<i>": L2 norm of that layer's leaves} of a parameter-shaped tree (params,
    gradients, updates); unrolled layers ("layer_<i>") or scanned ones ("layers", a norm per
    slice of the stacked axis 0). Leaves outside the layers (embeddings, final norm) are left
    out."""
    squares: dict[str, Array] = {}

    def add(name: str, value: Array) -> None:
        squares[name] = squares.get(name, 0.0) + value

    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys, leaf = _keys(path), jnp.asarray(leaf, jnp.float32)
        for key in keys:
            if _LAYER.fullmatch(key):
                add(f"{keys[0]}/{key}", jnp.sum(leaf * leaf))
                break
            if key == "layers":
                per_slice = jnp.sum(leaf * leaf, axis=tuple(range(1, leaf.ndim)))
                for index in range(leaf.shape[0]):
                    add(f"{keys[0]}/layer_{index}", per_slice[index])
                break
    return {name: jnp.sqrt(total) for name, total in squares.items()}


def unstack_layers(params: Any) -> Any:
    """The unrolled layout ({"layer_0": ..., ...}) of scanned params ({"layers": leaves stacked
    on axis 0}); the inverse of tfm.nn.models.stack_layer_params."""
    if not isinstance(params, Mapping):
        return params
    unrolled = {key: unstack_layers(value) for key, value in params.items() if key != "layers"}
    if "layers" in params:
        stacked = params["layers"]
        for index in range(jax.tree.leaves(stacked)[0].shape[0]):
            unrolled[f"layer_{index}"] = jax.tree.map(lambda leaf, i=index: leaf[i], stacked)
    return unrolled


def attention_stats(
    model: nn.Module, mode: str, params: Any, batch: Mapping[str, Array]
) -> dict[str, Array]:
    """{"attention_entropy/<stack>/layer_<i>": [heads], "attention_distance/...": [heads]} of
    every self-attention layer of `model` (unrolled, reference backend) on `batch` (every entry
    [batch, len]); real queries: segment id > 0 in rows with example weight > 0."""
    family = get_family(mode)
    _, variables = model.apply(
        {"params": params},
        *(batch[key] for key in family.inputs),
        **{keyword: batch[key] for keyword, key in family.keywords},
        deterministic=True,
        mutable=["intermediates"],
    )
    rows = batch.get("example_weights")
    stats = {}
    for path, weights in jax.tree_util.tree_flatten_with_path(variables["intermediates"])[0]:
        keys = _keys(path)
        if "self_attention" not in keys:
            continue  # cross-attention: queries and keys count different positions
        layer = next(key for key in keys if _LAYER.fullmatch(key))
        positions_key, segments_key = _STACK_KEYS.get(keys[0], _DECODER_KEYS)
        positions, valid = batch[positions_key], batch[segments_key] > 0
        if rows is not None:
            valid = valid & (rows[:, None] > 0)
        name = f"{keys[0]}/{layer}"
        stats[f"attention_entropy/{name}"] = attention_entropy(weights, valid)
        stats[f"attention_distance/{name}"] = attention_distance(
            weights, positions, positions, valid
        )
    return stats


def diagnostics_step(
    state: TrainState,
    batch: Mapping[str, Array],  # the step's training batch, every entry [batch, len]
    eval_batch: Mapping[str, Array],  # the fixed evaluation batch
    *,
    gradients: Callable[[TrainState, Mapping[str, Array]], Any],
    optimizer: optax.GradientTransformation,
    attention_model: nn.Module,
    mode: str,
) -> dict[str, Array]:
    """The diagnostics of the step `state` takes on `batch` (pure; state is not updated):
    norms of its gradient and update, of the params it produces, and the attention statistics
    of those params on `eval_batch`. Values are scalars or [heads]."""
    grads = gradients(state, batch)
    updates, _ = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    values = {}
    for family, tree in (("param_norm", params), ("grad_norm", grads), ("update_norm", updates)):
        values |= {f"{family}/{name}": norm for name, norm in layer_norms(tree).items()}
    return values | attention_stats(attention_model, mode, unstack_layers(params), eval_batch)


def named_scalars(values: Mapping[str, Any]) -> dict[str, float]:
    """diagnostics_step's values as "diagnostics/..." scalars, one per head for [heads] ones."""
    scalars = {}
    for name, value in values.items():
        value = np.asarray(value)
        if value.ndim == 0:
            scalars[f"diagnostics/{name}"] = float(value)
        else:
            scalars |= {f"diagnostics/{name}/head_{h}": float(v) for h, v in enumerate(value)}
    return scalars


def first_eval_batch(experiment: Experiment) -> dict[str, Any]:
    """The first batch of the first eval split (the first training batch's shape if the data
    has no eval split): the fixed batch of the attention statistics."""
    splits = experiment.eval_splits
    if splits:
        batch = next(iter(experiment.data.eval_batches(splits[0])))
    else:
        batches = experiment.data.train_iterator()
        batch = next(batches)
        if hasattr(batches, "close"):  # grain's prefetch thread
            batches.close()
    return sharding.shard_batch(dict(batch), experiment.mesh, rules=experiment.rules)


def jit_diagnostics(
    experiment: Experiment, shardings: Any, gradients: Callable
) -> Callable[[TrainState, Mapping[str, Array]], dict[str, float]]:
    """`diagnose(state, batch) -> {"diagnostics/...": float}`: diagnostics_step jit-compiled
    (the state as `shardings`, nothing donated, so call it before the train step), on the run's
    first eval batch, with the attention of an unrolled reference-backend copy of the model
    (the only backend that returns weights)."""
    mesh, rules = experiment.mesh, experiment.rules
    attention_config = experiment.model_config.replace(
        attention_backend="reference", scan_layers=False, remat="none"
    )
    step_fn = functools.partial(
        diagnostics_step, gradients=gradients, optimizer=experiment.optimizer,
        attention_model=model_for(attention_config, experiment.mode), mode=experiment.mode,
    )
    batch_sharding = sharding.batch_sharding(mesh, rules)
    jitted = InShardingContext(cpu_compile.jit(
        step_fn,
        cpu_kernels=cpu_compile.resolve_cpu_kernels(
            "auto", experiment.model_config.compute_dtype
        ),
        in_shardings=(shardings, batch_sharding, batch_sharding),
        out_shardings=sharding.replicated(mesh),
        platform=experiment.platform,
    ), experiment)
    eval_batch = first_eval_batch(experiment)
    return lambda state, batch: named_scalars(jax.device_get(jitted(state, batch, eval_batch)))
