"""The dense projection every layer uses: y = x . kernel over the last axes of x, operands in
the compute dtype, accumulated in float32 (the reference; tfm.kernels.linear may choose a faster
implementation of the same values)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear_dtypes(
    x: jax.Array,  # [..., *in_dims]
    kernel: jax.Array,  # [*in_dims, *out_dims]
    num_contracted: int,
    compute_dtype: jnp.dtype | str | None,
    out_dtype: jnp.dtype | str | None,
) -> tuple[jnp.dtype, jnp.dtype]:
    """(compute dtype, output dtype) of a `linear` call, after checking that x ends in the
    kernel's input dims."""
    in_dims = kernel.shape[:num_contracted]
    if tuple(x.shape[x.ndim - num_contracted :]) != tuple(in_dims):
        raise ValueError(
            f"linear: x {tuple(x.shape)} must end in the kernel's input dims {tuple(in_dims)}"
        )
    compute_dtype = jnp.dtype(compute_dtype or x.dtype)
    return compute_dtype, jnp.dtype(out_dtype or compute_dtype)


def linear(
    x: jax.Array,  # [..., *in_dims]
    kernel: jax.Array,  # [*in_dims, *out_dims]
    *,
    num_contracted: int = 1,
    compute_dtype: jnp.dtype | str | None = None,
    out_dtype: jnp.dtype | str | None = None,
) -> jax.Array:  # [..., *out_dims] in out_dtype (default compute_dtype)
    """Contracts the last `num_contracted` axes of x with the leading axes of kernel, operands
    in compute_dtype (default x.dtype), accumulated in float32."""
    compute_dtype, out_dtype = linear_dtypes(x, kernel, num_contracted, compute_dtype, out_dtype)
    x_axes = tuple(range(x.ndim - num_contracted, x.ndim))
    y = jax.lax.dot_general(
        x.astype(compute_dtype),
        kernel.astype(compute_dtype),
        ((x_axes, tuple(range(num_contracted))), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype)
