"""Context parallelism for a bias computed from the queries (Shaw et al. 2018's relative keys,
tfm.kernels.call.RelativeBias) and a term from the attention weights (their relative values,
RelativeValue): the all_gather strategy on the reference maths. Each device's queries (in
whatever order the rows were split, load balanced or not) attend the whole row's gathered keys
and values; the bias and the value term are evaluated from the local queries' positions and
the gathered keys' positions (global, never a chunk's local indices), and the value term reads
the same weights as the output, exactly the reference on one device.

The ring (tfm.kernels.context_parallel) does not run this: its online softmax never holds a
key block's normalised weights, so the value term would have to be accumulated alongside the
values (rescaled by the running max like them), which is not written yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from tfm.kernels import reference
from tfm.kernels.call import RelativeBias, RelativeValue
from tfm.kernels.context_parallel import AXIS, MeshAxes, SequenceMask, axes_by_rules, block_mask


def relative_gathered_attention(
    query: jax.Array,  # [batch, chunk, num_heads, head_dim], this device's queries
    key: jax.Array,  # [batch, chunk, num_kv_heads, head_dim], this device's keys
    value: jax.Array,  # like key
    mask: SequenceMask,  # this device's chunks
    relative: RelativeBias,  # positions: this device's chunks
    value_term: RelativeValue | None = None,  # positions: this device's chunks
    *,
    scale: float | None = None,
    axis_name: str = AXIS,
) -> jax.Array:  # [batch, chunk, num_heads, head_dim]
    """Per device under shard_map: keys, values, their indices, segments and positions gathered
    over `axis_name`; the reference maths with the relative bias of the local queries against
    the whole row, plus the value term from the same weights."""
    gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, axis=1, tiled=True)
    key_segments = None if mask.key_segments is None else gather(mask.key_segments)
    dense_mask = block_mask(mask, gather(mask.key_index), key_segments)
    scale = reference.default_scale(query.shape[-1]) if scale is None else float(scale)
    bias = relative.function(query, relative.params, relative.query_positions,
                             gather(relative.key_positions), scale)
    out, weights = reference.dot_product_attention(
        query, gather(key), gather(value), bias=bias, mask=dense_mask, scale=scale,
        return_weights=True)
    if value_term is None:
        return out
    term = value_term.function(weights, value_term.params, value_term.query_positions,
                               gather(value_term.key_positions))
    return out + term.astype(out.dtype)


def relative_context_attention(
    query: jax.Array,  # [batch, length, num_heads, head_dim], the whole (possibly permuted) row
    key: jax.Array,  # [batch, length, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    mask: SequenceMask,  # whole rows, in the same order as query
    relative: RelativeBias,  # params without a heads axis (replicated); whole rows' positions
    value_term: RelativeValue | None = None,  # likewise
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    scale: float | None = None,
    batch_axes: MeshAxes = None,
    head_axes: MeshAxes = None,
    axis_name: str = AXIS,
) -> jax.Array:  # [batch, length, num_heads, head_dim]
    """`relative_gathered_attention` under jax.shard_map: the length split over `axis_name`,
    the batch over `batch_axes`, the heads over `head_axes`; the tables whole on every device
    (their gradients summed over the mesh)."""
    row_spec = P(batch_axes, axis_name)
    tensor_spec = P(batch_axes, axis_name, head_axes, None)

    def specs(parts):  # a RelativeBias or RelativeValue's in_specs
        return None if parts is None else dataclasses.replace(
            parts, params=jax.tree.map(lambda _: P(), parts.params),
            query_positions=row_spec, key_positions=row_spec)

    run = functools.partial(relative_gathered_attention, scale=scale, axis_name=axis_name)
    return jax.shard_map(
        run, mesh=mesh, check_vma=False,
        in_specs=(tensor_spec, tensor_spec, tensor_spec, jax.tree.map(lambda _: row_spec, mask),
                  specs(relative), specs(value_term)),
        out_specs=tensor_spec,
    )(query, key, value, mask, relative, value_term)


def relative_attention_by_rules(
    query: jax.Array,  # [batch, length, num_heads, head_dim]
    key: jax.Array,  # [batch, length, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    mask: SequenceMask,  # whole rows
    relative: RelativeBias,
    value_term: RelativeValue | None = None,
    *,
    scale: float | None = None,
) -> jax.Array:  # [batch, length, num_heads, head_dim]
    """`relative_context_attention` over the mesh set around tracing, split by
    tfm.kernels.context_parallel.axes_by_rules."""
    mesh, batch, heads = axes_by_rules(query, key)
    return relative_context_attention(query, key, value, mask, relative, value_term, mesh=mesh,
                                      scale=scale, batch_axes=batch, head_axes=heads)
