"""tfm.kernels.cpu_dense.linear: values and both gradients against plain autodiff of an einsum, and
the
bfloat16 operands of its backward matmuls."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.kernels import cpu_compile, cpu_dense


def _inputs(in_dims, out_dims, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(2, 3, *in_dims)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(*in_dims, *out_dims)) * 0.3, jnp.float32)
    return x, kernel


# Wide and narrow kernels take the two weight-gradient formulations; (4, 5) contracts two axes.
@pytest.mark.parametrize("in_dims,out_dims", [((6,), (10,)), ((10,), (6,)), ((4, 5), (7,)),
                                              ((6,), (2, 3))])
def test_values_and_gradients_equal_autodiff(in_dims, out_dims):
    x, kernel = _inputs(in_dims, out_dims)
    n_in = len(in_dims)
    letters_in, letters_out = "ijk"[:n_in], "uv"[: len(out_dims)]
    spec = f"ab{letters_in},{letters_in}{letters_out}->ab{letters_out}"
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, *out_dims)), jnp.float32)

    def reference(x, kernel):
        return jnp.sum(jnp.einsum(spec, x, kernel, precision="highest") * cotangent)

    def fast(x, kernel):
        return jnp.sum(cpu_dense.linear(x, kernel, num_contracted=n_in) * cotangent)

    np.testing.assert_allclose(fast(x, kernel), reference(x, kernel), rtol=1e-5)
    for got, want in zip(jax.grad(fast, (0, 1))(x, kernel), jax.grad(reference, (0, 1))(x, kernel),
                         strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_backward_matmuls_take_bfloat16_operands():
    """With autodiff, the float32-accumulated forward made every backward matmul float32."""
    x, kernel = _inputs((8,), (16,))

    def loss(x, kernel):
        return jnp.sum(cpu_dense.linear(x, kernel, compute_dtype=jnp.bfloat16,
        out_dtype=jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, kernel)
    dot_eqns = []

    def collect(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                dot_eqns.append(eqn)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    collect(inner)

    collect(jaxpr.jaxpr)
    assert len(dot_eqns) == 3  # forward, grad of x, grad of kernel
    for eqn in dot_eqns:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16, jnp.bfloat16]
        assert eqn.outvars[0].aval.dtype == jnp.float32  # float32 accumulation
    grad_x, grad_kernel = jax.grad(loss, (0, 1))(x, kernel)
    assert grad_x.dtype == grad_kernel.dtype == jnp.float32  # the inputs' own dtypes


def _compiled_dot_operand_dtypes(program: str) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot in a compiled XLA program's text."""
    dtypes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", program))
    return [tuple(dtypes[name] for name in re.findall(r"%([\w.\-]+)", operands))
            for operands in re.findall(r" dot\(([^)]*)\)", program)]


# A wide and a narrow kernel: the two weight-gradient formulations.
@pytest.mark.parametrize("in_dims,out_dims", [((32,), (64,)), ((64,), (32,))])
def test_bfloat16_backward_matmuls_stay_bfloat16_when_compiled(in_dims, out_dims):
    """XLA's CPU backend upcasts a bf16 matmul to float32 unless its bf16 kernels (YNNPACK,
    cpu_kernels="ynnpack") take the operands' layout; every backward matmul must compile with
    the forward's operand dtype (bf16 wherever this CPU's kernels take bf16 at all), run, and
    match float32 to bf16 rounding."""
    x, kernel = _inputs(in_dims, out_dims)
    x = jnp.tile(x.reshape(-1, *in_dims), (8, 1))  # [48, in]: enough rows for YNNPACK

    def loss(x, kernel, compute_dtype):
        y = cpu_dense.linear(x, kernel, compute_dtype=compute_dtype, out_dtype=jnp.float32)
        return jnp.sum(jnp.sin(y))

    grad = cpu_compile.jit(jax.grad(loss, (0, 1)), static_argnums=2, cpu_kernels="ynnpack")
    program = grad.lower(x, kernel, jnp.bfloat16).compile().as_text()
    operand_dtypes = _compiled_dot_operand_dtypes(program)
    assert len(operand_dtypes) == 3 and len(set(operand_dtypes)) == 1, operand_dtypes
    got, want = grad(x, kernel, jnp.bfloat16), grad(x, kernel, jnp.float32)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0.05, atol=0.05 * float(jnp.abs(w).max()))


def test_mismatched_shapes_are_named():
    x, kernel = _inputs((6,), (4,))
    with pytest.raises(ValueError, match=r"must end in the kernel's input dims \(5,\)"):
        cpu_dense.linear(x, kernel[:5])


@pytest.mark.parametrize("in_dims,out_dims", [((32,), (64,)), ((64,), (32,))])
def test_bfloat16_tied_kernel_backward_runs_with_bf16_kernels(in_dims, out_dims):
    """A kernel passed transposed (a tied embedding's `table.T`): the caller's transpose of the
    kernel gradient must not be folded into the backward matmul, whose swapped operands the bf16
    kernels refuse (the compiled program failed at run time, "DotThunk BF16 x BF16 = F32", for
    d_model < vocab)."""
    x, kernel = _inputs(in_dims, out_dims)
    x = jnp.tile(x.reshape(-1, *in_dims), (8, 1))
    table = kernel.T  # [out, in], the layout an embedding table has

    def loss(x, table, compute_dtype):
        y = cpu_dense.linear(x, table.T, compute_dtype=compute_dtype, out_dtype=jnp.float32)
        return jnp.sum(jnp.sin(y))

    grad = cpu_compile.jit(jax.grad(loss, (0, 1)), static_argnums=2,
                               cpu_kernels="ynnpack_dots")
    got, want = grad(x, table, jnp.bfloat16), grad(x, table, jnp.float32)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0.05, atol=0.05 * float(jnp.abs(w).max()))
