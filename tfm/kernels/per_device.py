"""Running a per-device attention kernel (Pallas) over a mesh: under `jax.shard_map`, batch and
heads split as the layers' logical axis rules say, each device computing its own rows and
heads; without a mesh, Mosaic when lowering for TPU and Pallas interpret mode elsewhere."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec


def run(
    local: Callable[..., jax.Array],
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    rows: Any = None,  # pytree of [batch, length] arrays (segment ids, positions)
    heads: Any = None,  # pytree of [num_heads, ...] arrays (per-head parameters)
) -> jax.Array:  # [batch, q_len, num_heads, head_dim]
    """local(query, key, value, rows, heads, interpret=...) on every device's share, where
    interpret is None when the platform is only known at lowering (no mesh: the kernel picks
    by jax.lax.platform_dependent), else whether the mesh's devices are not TPUs."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(query, key, value, rows, heads, interpret=None)
    interpret = mesh.abstract_device.platform != "tpu"
    if mesh.size == 1:
        return local(query, key, value, rows, heads, interpret=interpret)
    query_spec = nn.logical_to_mesh_axes(("batch", "length", "heads", "head_dim"))
    kv_spec = nn.logical_to_mesh_axes(("batch", "length", "kv_heads", "head_dim"))
    rows_spec = nn.logical_to_mesh_axes(("batch", "length"))
    query_spec = divisible(query_spec, query.shape, mesh)
    kv_spec = divisible(kv_spec, key.shape, mesh)
    if query_spec[2] != kv_spec[2]:  # heads split one way, kv heads another: keep both whole,
        query_spec = PartitionSpec(*query_spec[:2], None, *query_spec[3:])  # so each device's
        kv_spec = PartitionSpec(*kv_spec[:2], None, *kv_spec[3:])  # query heads meet their kv
    rows_specs = jax.tree.map(lambda array: divisible(rows_spec, array.shape, mesh), rows)
    heads_specs = jax.tree.map(
        lambda array: PartitionSpec(query_spec[2], *([None] * (array.ndim - 1))), heads)

    def per_shard(query, key, value, rows, heads):
        return local(query, key, value, rows, heads, interpret=interpret)

    return jax.shard_map(
        per_shard, mesh=mesh, check_vma=False,
        in_specs=(query_spec, kv_spec, kv_spec, rows_specs, heads_specs),
        out_specs=query_spec,
    )(query, key, value, rows, heads)


def divisible(
    spec: PartitionSpec, shape: tuple[int, ...], mesh: jax.sharding.AbstractMesh
) -> PartitionSpec:
    """`spec` without the mesh axes that do not divide their dimension (e.g. the one-row
    batch of parameter initialisation): those dimensions stay whole on every device."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))

    def fits(axes: str | tuple[str, ...] | None, length: int) -> bool:
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return length % math.prod(sizes[name] for name in names) == 0

    return PartitionSpec(*(axes if fits(axes, length) else None
                           for axes, length in zip(spec, shape, strict=False)))


def by_platform(call: Callable[..., Any], interpret: bool | None, *args: Any) -> Any:
    """call(*args, interpret=...): Mosaic on TPU, interpret mode elsewhere; when `interpret`
    is None, chosen at lowering by jax.lax.platform_dependent."""
    if interpret is not None:
        return call(*args, interpret=interpret)
    return jax.lax.platform_dependent(
        *args,
        tpu=lambda *a: call(*a, interpret=False),
        default=lambda *a: call(*a, interpret=True),
    )
