"""The dense projection on CPU: `tfm.nn.dense.linear` with a hand-written backward pass, so
the compiled CPU training step stays lean.

`linear(x, kernel)` is `x . kernel` over the last axes of x, with what autodiff does not give on
CPU:
- Both passes feed compute-dtype operands to the matmul and accumulate in float32. With autodiff,
  a float32-accumulated forward turns every incoming gradient into float32, so in bfloat16 all
  backward matmuls ran float32 x float32 and never used the CPU's bf16 units.
- The incoming gradient is materialised once (an optimization barrier), so an expensive
  elementwise producer (e.g. the exact GELU derivative) is computed once instead of being fused
  into both backward matmuls and into a transposing copy; and the weight gradient transposes the
  narrower of its two operands (XLA's CPU matmul wants the left operand contracted on its minor
  axis, so `x^T g` copies x, and `(g^T x)^T` copies g).
- In 16-bit compute dtypes the backward matmuls get their transposed operands as row-major
  copies (`_transposed`): XLA's CPU bf16 kernels (YNNPACK) take only that layout, and upcast
  any other matmul to float32 (benchmarks/README.md has what this bought).
The values equal `jnp.einsum` up to float32 rounding; tests check both passes against autodiff.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tfm.kernels.reference import linear_dtypes


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _linear_2d(x: jax.Array, kernel: jax.Array, compute_dtype: jnp.dtype, out_dtype: jnp.dtype):
    # x: [tokens, in_features]; kernel: [in_features, out_features] -> [tokens, out_features]
    return _matmul(x, kernel, compute_dtype).astype(out_dtype)


def _matmul(a: jax.Array, b: jax.Array, compute_dtype: jnp.dtype) -> jax.Array:
    """a: [m, k] . b: [k, n] -> [m, n] float32, operands in compute_dtype."""
    return jnp.dot(
        a.astype(compute_dtype), b.astype(compute_dtype), preferred_element_type=jnp.float32
    )


def _linear_2d_fwd(x, kernel, compute_dtype, out_dtype):
    return _linear_2d(x, kernel, compute_dtype, out_dtype), (x, kernel)


def _linear_2d_bwd(compute_dtype, out_dtype, residuals, grad):
    x, kernel = residuals
    grad = jax.lax.optimization_barrier(grad.astype(compute_dtype))  # [tokens, out]
    grad_x = _matmul(grad, _transposed(kernel, compute_dtype), compute_dtype).astype(x.dtype)
    in_features, out_features = kernel.shape
    if in_features <= out_features:  # transpose x, the narrower operand
        grad_kernel = _matmul(_transposed(x, compute_dtype), grad, compute_dtype)
    else:
        grad_kernel = _matmul(_transposed(grad, compute_dtype), x, compute_dtype)
    if _copies_transposes(compute_dtype):
        # Keep XLA from folding a transpose of either gradient (ours below, or the caller's, e.g.
        # a tied embedding's `table.T`) into its matmul: that swaps the operands into a layout
        # the bf16 kernels refuse, and the program fails at run time.
        grad_x, grad_kernel = jax.lax.optimization_barrier((grad_x, grad_kernel))
    if in_features > out_features:
        grad_kernel = grad_kernel.T
    return grad_x, grad_kernel.astype(kernel.dtype)


def _copies_transposes(compute_dtype: jnp.dtype) -> bool:
    """Whether matmuls in compute_dtype get their transposed operands as row-major copies:
    16-bit ones. XLA's CPU backend hands a bfloat16 matmul to its bf16 kernels (YNNPACK) only
    when the left operand is contracted on its minor axis and the right one on its major axis;
    otherwise it upcasts the whole matmul to float32. Float32 kernels read transposed operands
    as they are, where the copies only cost time."""
    return jnp.dtype(compute_dtype).itemsize < 4


def _transposed(a: jax.Array, compute_dtype: jnp.dtype) -> jax.Array:
    """a: [m, n] -> a^T [n, m] in compute_dtype; a row-major copy for 16-bit dtypes."""
    if not _copies_transposes(compute_dtype):
        return a.astype(compute_dtype).T
    return swap_minor(a.astype(compute_dtype))


def swap_minor(a: jax.Array) -> jax.Array:
    """a: [..., m, n] -> [..., n, m], written out row-major (a copy) for a matmul operand.

    A plain transpose reaches XLA as a layout (a view the matmul reads strided), which XLA's CPU
    bf16 kernels do not take. Swapping with a trailing unit axis and reshaping back makes XLA
    write the transposed array, and the optimization barrier keeps it from folding the copy
    back into the matmul."""
    *lead, m, n = a.shape
    swapped = jnp.swapaxes(a.reshape(*lead, m, n, 1), -3, -2)
    return jax.lax.optimization_barrier(swapped.reshape(*lead, n, m))


_linear_2d.defvjp(_linear_2d_fwd, _linear_2d_bwd)


def linear(
    x: jax.Array,
    kernel: jax.Array,
    *,
    num_contracted: int = 1,
    compute_dtype: jnp.dtype | str | None = None,
    out_dtype: jnp.dtype | str | None = None,
) -> jax.Array:
    """Contracts the last `num_contracted` axes of x with the leading axes of kernel.

    x: [..., *in_dims]; kernel: [*in_dims, *out_dims] -> [..., *out_dims] in out_dtype
    (default compute_dtype), accumulated in float32. compute_dtype (default x.dtype) is the
    matmul operand dtype in both passes; gradients come back in x's and kernel's own dtypes.
    """
    compute_dtype, out_dtype = linear_dtypes(x, kernel, num_contracted, compute_dtype, out_dtype)
    in_dims, out_dims = kernel.shape[:num_contracted], kernel.shape[num_contracted:]
    batch_dims = x.shape[: x.ndim - num_contracted]
    x2 = x.reshape(math.prod(batch_dims), math.prod(in_dims))
    kernel2 = kernel.reshape(math.prod(in_dims), math.prod(out_dims))
    y = _linear_2d(x2, kernel2, compute_dtype, out_dtype)
    return y.reshape(*batch_dims, *out_dims)


def concatenate_kernels(kernels: list[jax.Array], num_contracted: int) -> jax.Array:
    """[*in_dims, *out_dims_i] kernels -> one [*in_dims, sum_i prod(out_dims_i)] kernel, for
    one wide matmul in place of several narrow ones (faster on CPU)."""
    in_dims = kernels[0].shape[:num_contracted]
    flat = [kernel.reshape(*in_dims, -1) for kernel in kernels]
    return flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=-1)


def split_outputs(y: jax.Array, out_dims: list[tuple[int, ...]]) -> list[jax.Array]:
    """The output [..., sum_i prod(out_dims_i)] of `concatenate_kernels`' matmul split back
    into each kernel's [..., *out_dims_i]."""
    widths = [math.prod(dims) for dims in out_dims]
    outputs = jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1) if len(widths) > 1 else [y]
    return [out.reshape(*out.shape[:-1], *dims)
            for out, dims in zip(outputs, out_dims, strict=True)]
