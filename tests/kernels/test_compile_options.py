"""tfm.kernels.cpu_compile: jax.jit with tfm's XLA options, nested or not, same numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.kernels import cpu_compile


def _mlp(x, w1, w2):  # x: [rows, d]; w1: [d, f]; w2: [f, d]
    return jax.nn.gelu(x @ w1) @ w2 + x


@pytest.fixture
def fresh_options():
    cpu_compile.compiler_options.cache_clear()
    yield
    cpu_compile.compiler_options.cache_clear()


def _inputs():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(keys[0], (8, 32)), jax.random.normal(keys[1], (32, 64)) * 0.1,
            jax.random.normal(keys[2], (64, 32)) * 0.1)


def test_jit_matches_jax_jit_top_level_nested_and_lowered():
    x, w1, w2 = _inputs()
    reference = jax.jit(_mlp)(x, w1, w2)
    fast = cpu_compile.jit(_mlp)
    np.testing.assert_allclose(fast(x, w1, w2), reference, rtol=1e-5, atol=1e-6)
    # Inside another jit the arguments are tracers: a nested jax.jit may not carry options.
    outer = jax.jit(lambda x, w1, w2: fast(x, w1, w2) * 2.0)
    np.testing.assert_allclose(outer(x, w1, w2), 2.0 * reference, rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda w1: fast(x, w1, w2).sum())(w1)
    np.testing.assert_allclose(grads, jax.grad(lambda w1: _mlp(x, w1, w2).sum())(w1),
                               rtol=1e-5, atol=1e-6)
    compiled = fast.lower(x, w1, w2).compile()
    np.testing.assert_allclose(compiled(x, w1, w2), reference, rtol=1e-5, atol=1e-6)


def test_jit_as_decorator_keeps_static_arguments():
    calls = []

    def power(x, *, exponent):  # x: [n]
        calls.append(exponent)
        return x**exponent

    fast = cpu_compile.jit(static_argnames=("exponent",))(power)
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(fast(x, exponent=3), x**3)
    np.testing.assert_array_equal(fast(x, exponent=3), x**3)
    np.testing.assert_array_equal(fast(x, exponent=2), x**2)
    assert calls == [3, 2]  # traced once per static value, as jax.jit does
    assert fast.__name__ == "power"


def test_options_on_cpu_and_the_ways_to_turn_them_off(fresh_options, monkeypatch):
    if jax.default_backend() != "cpu":
        pytest.skip("CPU options")
    monkeypatch.delenv("TFM_XLA_DEFAULTS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    options = cpu_compile.compiler_options()
    assert options in (None, cpu_compile.CPU_OPTIONS)  # None: this jaxlib lacks the option
    cpu_compile.compiler_options.cache_clear()
    monkeypatch.setenv("TFM_XLA_DEFAULTS", "0")
    assert cpu_compile.compiler_options() is None
    cpu_compile.compiler_options.cache_clear()
    monkeypatch.delenv("TFM_XLA_DEFAULTS")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")  # the user's
    assert cpu_compile.compiler_options() is None


def test_using_compiles_calls_inside_it_with_the_given_options(fresh_options, monkeypatch):
    monkeypatch.delenv("TFM_XLA_DEFAULTS", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    if cpu_compile.compiler_options() is None:
        pytest.skip("not a CPU, or this jaxlib lacks the option")
    x, w1, w2 = _inputs()
    step = cpu_compile.jit(_mlp)

    def program() -> str:
        return step.lower(x, w1, w2).compile().as_text()

    with cpu_compile.using(None):  # XLA's defaults hand the dots to YNNPACK
        assert "__ynn_fusion" in program()
        inside = step(x, w1, w2)
    assert "__ynn_fusion" not in program()  # tfm's options again
    np.testing.assert_allclose(inside, step(x, w1, w2), rtol=1e-5, atol=1e-6)
    with cpu_compile.using({cpu_compile.YNN_FUSION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}):
        assert "__ynn_fusion" in program()


def test_a_step_can_ask_for_xla_cpu_defaults(fresh_options, monkeypatch):
    """cpu_kernels="ynnpack" (train.cpu_kernels) compiles that step with XLA's defaults, which
    hand its dots to YNNPACK, while other steps keep tfm's options; same numbers."""
    monkeypatch.delenv("TFM_XLA_DEFAULTS", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    if cpu_compile.compiler_options() is None:
        pytest.skip("not a CPU, or this jaxlib lacks the option")
    x, w1, w2 = _inputs()
    steps = {kind: cpu_compile.jit(_mlp, cpu_kernels=kind) for kind in ("xla", "ynnpack")}
    programs = {kind: step.lower(x, w1, w2).compile().as_text() for kind, step in steps.items()}
    assert "__ynn_fusion" in programs["ynnpack"] and "__ynn_fusion" not in programs["xla"]
    np.testing.assert_allclose(steps["ynnpack"](x, w1, w2), steps["xla"](x, w1, w2),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cpu_kernels='mkl' must be one of"):
        cpu_compile.jit(_mlp, cpu_kernels="mkl")


def test_cpu_kernels_can_be_chosen_per_call_from_the_arguments(fresh_options, monkeypatch):
    """cpu_kernels may be a function of the call's (bound) arguments: here YNNPACK from 8 rows."""
    monkeypatch.delenv("TFM_XLA_DEFAULTS", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    if cpu_compile.compiler_options() is None:
        pytest.skip("not a CPU, or this jaxlib lacks the option")
    x, w1, w2 = _inputs()  # x: [8, 32]

    def by_rows(arguments):
        return "ynnpack" if arguments["x"].shape[0] >= 8 else "xla"

    step = cpu_compile.jit(_mlp, cpu_kernels=by_rows)
    assert "__ynn_fusion" in step.lower(x, w1, w2=w2).compile().as_text()
    assert "__ynn_fusion" not in step.lower(x[:4], w1, w2).compile().as_text()
    np.testing.assert_allclose(step(x, w1, w2), _mlp(x, w1, w2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(step(x[:4], w1, w2), _mlp(x[:4], w1, w2), rtol=1e-5, atol=1e-6)
    wrong = cpu_compile.jit(_mlp, cpu_kernels=lambda arguments: "mkl")
    with pytest.raises(ValueError, match="cpu_kernels chose 'mkl'"):
        wrong(x, w1, w2)


def test_a_step_can_ask_for_onednn_dots(fresh_options, monkeypatch):
    """cpu_kernels="onednn" hands the step's dots (batched ones too, as attention's) to oneDNN
    on an x86-64 CPU; values and gradients equal tfm's own options' to float32 rounding."""
    monkeypatch.delenv("TFM_XLA_DEFAULTS", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cpu_compile.onednn_options.cache_clear()
    if cpu_compile.onednn_options() in (None, cpu_compile.compiler_options()):
        pytest.skip("not an x86-64 CPU, or this jaxlib lacks the oneDNN options")
    x, w1, w2 = _inputs()

    def loss(x, w1, w2):  # x: [rows, d]; a batched dot as well, [2, rows/2, d] x [2, d, f]
        batched = jnp.einsum("brd,bdf->brf", x.reshape(2, -1, x.shape[-1]), jnp.stack([w1, w1]))
        return (_mlp(x, w1, w2) ** 2).sum() + jnp.tanh(batched).sum()

    steps = {kind: cpu_compile.jit(jax.value_and_grad(loss, argnums=(1, 2)), cpu_kernels=kind)
             for kind in ("xla", "onednn")}
    programs = {kind: step.lower(x, w1, w2).compile().as_text() for kind, step in steps.items()}
    assert programs["onednn"].count("__onednn_fusion") >= 3
    assert "__onednn_fusion" not in programs["xla"]
    entry = programs["onednn"][programs["onednn"].index("ENTRY"):]
    assert " dot(" not in entry  # every dot, forward and backward, is in a oneDNN fusion
    (value, grads), (value_ref, grads_ref) = steps["onednn"](x, w1, w2), steps["xla"](x, w1, w2)
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(grad, grad_ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_onednn=false")  # the user's flag wins
    cpu_compile.onednn_options.cache_clear()
    assert cpu_compile.onednn_options() == cpu_compile.compiler_options()
    cpu_compile.onednn_options.cache_clear()


CACHE_SCRIPT = """
import sys, jax, jax.numpy as jnp
from tfm.kernels import cpu_compile
events = []
jax.monitoring.register_event_listener(lambda name, **kwargs: events.append(name))
jax.jit(jnp.cos)(1.0)  # compiled before the cache is on: it must still take effect after
cpu_compile.use_compilation_cache(sys.argv[1], min_compile_seconds=0)
step = cpu_compile.jit(lambda x: jnp.tanh(x @ x.T).sum())
print(float(step(jnp.arange(12.0).reshape(3, 4))))
print("HITS", sum(name.endswith("/cache_hits") for name in events))
"""


def test_compilation_cache_is_written_then_read_by_a_later_process(tmp_path):
    """The first process compiles and writes the step to the folder; a second process with the
    same folder loads it (a cache hit) and computes the same value."""
    import subprocess
    import sys

    cache = tmp_path / "xla_cache"
    runs = [
        subprocess.run([sys.executable, "-c", CACHE_SCRIPT, str(cache)], capture_output=True,
                       text=True, check=True).stdout.split("\n")
        for _ in range(2)
    ]
    assert any(cache.iterdir()), "the first run wrote no cache entry"
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == "HITS 0" and runs[1][1] != "HITS 0", runs


@pytest.mark.parametrize("bf16_native", [True, False])
def test_auto_cpu_kernels_take_ynnpack_dots_for_bfloat16_on_cpus_with_bf16_units(
    monkeypatch, bf16_native
):
    """train.cpu_kernels="auto": YNNPACK's bf16 matmuls where the CPU computes bf16, XLA's own
    kernels otherwise; explicit choices pass through, unknown ones are named."""
    monkeypatch.setattr(cpu_compile.hardware, "cpu_features",
                        lambda: {"bf16_native": bf16_native})
    resolve = cpu_compile.resolve_cpu_kernels
    assert resolve("auto", jnp.bfloat16) == ("ynnpack_dots" if bf16_native else "xla")
    assert resolve("auto", "float32") == "xla"
    assert resolve("onednn", jnp.bfloat16) == "onednn"
    with pytest.raises(ValueError, match="cpu_kernels='mkl' must be one of .*'auto'"):
        resolve("mkl", jnp.float32)


def test_ynnpack_dots_hand_only_the_dots_to_ynnpack(fresh_options, monkeypatch):
    """cpu_kernels="ynnpack_dots": the dot in a YNNPACK fusion, the row reductions left to XLA
    (which XLA's defaults, "ynnpack", would hand to YNNPACK too); same values as "xla"."""
    monkeypatch.delenv("TFM_XLA_DEFAULTS", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cpu_compile.ynnpack_dots_options.cache_clear()
    if cpu_compile.ynnpack_dots_options() is None:
        pytest.skip("not a CPU, or this jaxlib lacks the option")
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    x, w = jax.random.normal(keys[0], (64, 128)), jax.random.normal(keys[1], (128, 128)) * 0.1

    def normalized(x, w):  # x: [rows, d]; w: [d, d]; a dot, then two row reductions
        y = x @ w
        y = y - jnp.mean(y, axis=-1, keepdims=True)
        return y / jnp.sqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)

    kinds = ("ynnpack_dots", "ynnpack", "xla")
    steps = {kind: cpu_compile.jit(normalized, cpu_kernels=kind) for kind in kinds}
    entries = {}
    for kind, step in steps.items():
        program = step.lower(x, w).compile().as_text()
        entries[kind] = program[program.index("ENTRY"):]
    assert entries["ynnpack_dots"].count("__ynn_fusion") == 1
    assert " dot(" not in entries["ynnpack_dots"]
    assert entries["ynnpack"].count("__ynn_fusion") > 1  # the reductions too, by default
    np.testing.assert_allclose(steps["ynnpack_dots"](x, w), steps["xla"](x, w),
                               rtol=1e-5, atol=1e-5)
