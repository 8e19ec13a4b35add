"""Running a per-device attention kernel (Pallas) over a mesh: under `jax.shard_map`, batch and
heads split as the layers' logical axis rules say, each device computing its own rows and
heads; without a mesh, the compiler is picked when lowering: Mosaic for TPU, Triton for GPU,
Pallas interpret mode elsewhere.

The mesh is the one set around tracing (jax.set_mesh; tfm.parallel.sharding.sharding_context
sets it with the logical rules). A Mosaic kernel cannot be partitioned by the compiler, so a
step traced without one over arrays that live on several devices is refused here, with what to
add (`context_mesh`), rather than deep inside Pallas when it lowers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

COMPILERS = ("mosaic", "triton", "interpret")  # how a Pallas kernel is compiled
COMPILER_OF_PLATFORM = {"tpu": "mosaic", "gpu": "triton", "cuda": "triton"}
LANES = 128  # TPU lane width: kernels pad lengths to whole multiples of it
BLOCK_CHOICES = (512, 256, LANES)  # the largest that divides the padded length is used
PADDING_KEY_SEGMENT = -1  # no query has it, so padded keys are never attended


def described_by_parts(call: Any, q_len: int, kv_len: int) -> bool:
    """Whether an AttentionCall's mask is described by its parts (call.structure) in a form a
    blocked kernel can build: by index (structure.by_index), no KV cache read, and causal or
    windowed only when queries and keys are the same positions (self-attention)."""
    structure = call.structure
    if call.cache_layout or structure is None or not structure.by_index:
        return False
    return q_len == kv_len or not (structure.causal or structure.window is not None)


def chunk_of_cache(call: Any, q_len: int, kv_len: int) -> bool:
    """Whether an AttentionCall is a prefill chunk reading a KV cache in a form a blocked kernel
    with a per-row query offset builds (tfm.kernels.flex_attention): causal from
    structure.query_offset by index (no window by positions, no relative bias), keys in the
    model's layout (the reference cache layout), and at least one block (LANES) of queries;
    fewer (a decoding step's one) cost less on the reference than a block padded from them."""
    structure = call.structure
    return (structure is not None and structure.causal and structure.query_offset is not None
            and structure.query_positions is None and structure.relative is None
            and q_len >= LANES and kv_len >= q_len)


def blocked(call: Any, q_len: int, kv_len: int) -> bool:
    """Whether a blocked kernel that takes a query offset can build the call's mask:
    `described_by_parts`, or `chunk_of_cache`."""
    return described_by_parts(call, q_len, kv_len) or chunk_of_cache(call, q_len, kv_len)


def round_up(length: int) -> int:
    """`length` padded to whole 128-lane blocks."""
    return -(-length // LANES) * LANES


def resident_bytes(length: int, head_dim: int, dtype: Any, count: int, buffers: int = 2) -> int:
    """On-chip bytes of `count` whole-head [length, head_dim] arrays, `buffers` copies each,
    lanes padded to 128, plus their [1, length] position and segment rows (8 sublanes)."""
    return buffers * count * length * (round_up(head_dim) * jnp.dtype(dtype).itemsize + 2 * 8 * 4)


def device_kind() -> str:
    """The device kind (e.g. "TPU v5 lite") of the mesh set around tracing (inside shard_map
    too; a deviceless compile's topology devices), else of jax's first device: the chip a
    kernel is compiled for."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return (device or jax.devices()[0]).device_kind


def block_size(padded: int, largest: int | None = None) -> int:
    """The largest of BLOCK_CHOICES (at most `largest`) that divides a padded length."""
    return next(size for size in BLOCK_CHOICES
                if padded % size == 0 and (largest is None or size <= largest))


class MeshContextError(ValueError):
    """A per-device kernel is traced over arrays on several devices without the mesh set."""


def context_mesh(backend: str, *arrays: Any) -> jax.sharding.AbstractMesh:
    """The mesh set around tracing (jax.sharding.get_abstract_mesh). Raises MeshContextError
    when none is set but `arrays` (pytrees) live on several devices: jit's inputs carry their
    mesh in their types, and without the mesh in context the kernel would run unpartitioned
    over them (on TPU: "Mosaic kernels cannot be automatically partitioned"). `backend`: the
    config field and value that chose the kernel, e.g. "attention_backend='splash'"."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    for array in jax.tree.leaves(arrays):
        own = getattr(getattr(jax.typeof(array), "sharding", None), "mesh", None)
        if own is not None and not own.empty and own.size > 1:
            sizes = ", ".join(f"{name!r}: {size}"
                              for name, size in zip(own.axis_names, own.axis_sizes, strict=True))
            field = backend.split("=")[0]
            raise MeshContextError(
                f"{backend} runs a Pallas kernel on each device's share under jax.shard_map, "
                f"which needs the mesh set while tracing: its inputs live on {own.size} devices "
                f"({{{sizes}}}) but no mesh is set; trace and call the jitted step inside `with "
                "tfm.parallel.sharding.sharding_context(mesh):` (jax.set_mesh(mesh) and flax's "
                f"nn.logical_axis_rules, which say how batch and heads split), or set "
                f"{field}='reference'")
    return mesh


def run(
    local: Callable[..., jax.Array],
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    rows: Any = None,  # pytree of [batch, length] arrays (segment ids, positions)
    heads: Any = None,  # pytree of [num_heads, ...] arrays (per-head parameters)
    *,
    backend: str = "attention_backend",
) -> jax.Array:  # [batch, q_len, num_heads, head_dim]
    """local(query, key, value, rows, heads, compiler=...) on every device's share, where
    compiler (COMPILERS) is None when the platform is only known at lowering (no mesh: the
    kernel picks by jax.lax.platform_dependent, `by_platform`), else the mesh's devices'.
    `backend` (e.g. "attention_backend='splash'") names it when no mesh is set over inputs on
    several devices (`context_mesh`)."""
    mesh = context_mesh(backend, query, key, value, rows, heads)
    if mesh.empty:
        return local(query, key, value, rows, heads, compiler=None)
    compiler = COMPILER_OF_PLATFORM.get(mesh.abstract_device.platform, "interpret")
    if mesh.size == 1:
        return local(query, key, value, rows, heads, compiler=compiler)
    # The sequence stays whole: a call's queries attend all of its keys. A mesh's context axis
    # splits it only inside tfm.kernels.context_parallel, which runs the kernel on each chunk.
    query_spec = nn.logical_to_mesh_axes(("batch", None, "heads", "head_dim"))
    kv_spec = nn.logical_to_mesh_axes(("batch", None, "kv_heads", "head_dim"))
    rows_spec = nn.logical_to_mesh_axes(("batch", None))
    query_spec = divisible(query_spec, query.shape, mesh)
    kv_spec = divisible(kv_spec, key.shape, mesh)
    if query_spec[2] != kv_spec[2]:  # heads split one way, kv heads another: keep both whole,
        query_spec = PartitionSpec(*query_spec[:2], None, *query_spec[3:])  # so each device's
        kv_spec = PartitionSpec(*kv_spec[:2], None, *kv_spec[3:])  # query heads meet their kv
    rows_specs = jax.tree.map(lambda array: divisible(rows_spec, array.shape, mesh), rows)
    heads_specs = jax.tree.map(
        lambda array: PartitionSpec(query_spec[2], *([None] * (array.ndim - 1))), heads)

    def per_shard(query, key, value, rows, heads):
        return local(query, key, value, rows, heads, compiler=compiler)

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


def by_platform(call: Callable[..., Any], compiler: str | None, *args: Any) -> Any:
    """call(*args, compiler=...) with compiler one of COMPILERS; when `compiler` is None,
    chosen at lowering by jax.lax.platform_dependent (Mosaic for TPU, Triton for CUDA GPUs,
    interpret mode elsewhere)."""
    if compiler is not None:
        return call(*args, compiler=compiler)
    return jax.lax.platform_dependent(
        *args,
        tpu=lambda *a: call(*a, compiler="mosaic"),
        cuda=lambda *a: call(*a, compiler="triton"),
        default=lambda *a: call(*a, compiler="interpret"),
    )


def rotate(tree: Any, axis_name: str) -> Any:
    """Every array of `tree` sent to the next device around `axis_name` (i -> i + 1), inside
    jax.shard_map: one step of a ring."""
    size = jax.lax.axis_size(axis_name)
    pairs = [(i, (i + 1) % size) for i in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, pairs), tree)
