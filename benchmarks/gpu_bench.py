"""The GPU checks of the speed issue, in one short run (benchmarks/gpu.sh calls this).

1. cuDNN flash attention against the xla backend, bf16, causal + padding mask: values and the
   three gradients (max abs difference), and fwd+bwd time of each.
2. Training MFU at the GPT-2-small shape (12 layers, d_model 768, 12 heads, seq 1024, vocab
   50,257, bf16 compute, cuDNN attention, AdamW), against the device's bf16 peak
   (tfm.training.flops).
2b. cuDNN with a learned logit bias (T5-style [1, heads, T, T], batch 4): the bias gradient
   against the xla backend's (jax-ml/jax#27184, #30593 report it missing or batch-1 only).
   Until this shows it right, tfm never routes a learned bias to cuDNN.
3. Batch-1 greedy decoding (bf16 weights and cache) as a fraction of the HBM-bandwidth bound
   (bf16 weight bytes per token over the device's bandwidth, measured with a large copy).

Needs only jax, flax, optax and tfm's model code (no data stack). Writes $OUT/gpu.json (or
benchmarks/results/gpu.json) and prints a markdown table.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tfm import kernels
from tfm.decode.generate import lm_generate
from tfm.kernels import hardware
from tfm.nn import attention
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM
from tfm.training import flops, losses

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, repeats: int = 10) -> float:
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def attention_check() -> dict:
    batch, length, heads, head_dim = 4, 1024, 12, 64
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (batch, length, heads, head_dim), jnp.bfloat16)
               for key in keys)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    valid = jnp.arange(length)[None] < jnp.array([[length], [length - 100], [500], [length]])
    mask = attention.combine_masks(attention.causal_mask(positions, positions),
                                   attention.padding_mask(valid))
    result = {}
    outs = {}
    for backend in ("xla", "cudnn"):
        # The mask is an argument: captured as a constant, XLA spent ~8 s folding it.
        def loss(q, k, v, mask, backend=backend):
            out = kernels.attention(q, k, v, mask=mask, backend=backend, causal=True)
            return jnp.sum(out.astype(jnp.float32) ** 2), out
        grad_fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
        (_, out), grads = grad_fn(q, k, v, mask)
        outs[backend] = (out, grads)
        result[f"{backend}_fwd_bwd_ms"] = 1e3 * timed(lambda f=grad_fn: f(q, k, v, mask))
    (out_x, grads_x), (out_c, grads_c) = outs["xla"], outs["cudnn"]
    result["max_abs_diff_out"] = float(jnp.max(jnp.abs(out_x.astype(jnp.float32) -
                                                       out_c.astype(jnp.float32))))
    for name, gx, gc in zip("qkv", grads_x, grads_c, strict=True):
        result[f"max_abs_diff_grad_{name}"] = float(
            jnp.max(jnp.abs(gx.astype(jnp.float32) - gc.astype(jnp.float32))))
    return result


def bias_gradient_check() -> dict:
    """cuDNN's gradient w.r.t. a learned [1, heads, T, T] bias, batch 4, against xla's."""
    batch, length, heads, head_dim = 4, 512, 8, 64
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    q, k, v = (jax.random.normal(key, (batch, length, heads, head_dim), jnp.bfloat16)
               for key in keys[:3])
    bias = 0.5 * jax.random.normal(keys[3], (1, heads, length, length), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    mask = attention.causal_mask(positions, positions)
    grads = {}
    for backend in ("xla", "cudnn"):
        def loss(q, k, v, bias, backend=backend):
            out = kernels.attention(q, k, v, bias=bias, mask=mask, backend=backend)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        grads[backend] = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(q, k, v, bias)
    result = {}
    for name, gx, gc in zip(("q", "k", "v", "bias"), grads["xla"], grads["cudnn"], strict=True):
        gx, gc = gx.astype(jnp.float32), gc.astype(jnp.float32)
        result[f"grad_{name}_max_abs_diff"] = float(jnp.max(jnp.abs(gx - gc)))
        result[f"grad_{name}_max_abs"] = float(jnp.max(jnp.abs(gx)))
    # Right means: within bf16 rounding of xla's, relative to its size.
    result["bias_gradient_right"] = bool(
        result["grad_bias_max_abs_diff"] <= 0.05 * max(result["grad_bias_max_abs"], 1e-6))
    return result


def flex_check(length: int = 2048) -> dict:
    """tfm's flex kernel (Triton here) with a T5 bias: values and gradients (q, k, v, table)
    against the reference on this GPU; fwd+bwd time against cuDNN fed the same bias written
    out ([batch, heads, T, T]) and against the reference."""
    import functools

    from tfm.kernels.call import AttentionStructure, BlockBias
    from tfm.nn import positions as P

    batch, heads, head_dim = 4, 12, 64
    keys = jax.random.split(jax.random.PRNGKey(2), 4)
    q, k, v = (jax.random.normal(key, (batch, length, heads, head_dim), jnp.bfloat16)
               for key in keys[:3])
    table = (0.5 * jax.random.normal(keys[3], (heads, 32), jnp.float32),)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    function = functools.partial(P.t5_block_bias, bidirectional=False, num_buckets=32,
                                 max_distance=128)
    mask = attention.causal_mask(positions, positions)

    def loss(q, k, v, table, backend):
        bias = P.dense_from_blocks(function, table, positions, positions)
        structure = AttentionStructure(True, None, None, None, BlockBias(
            function, table, positions, positions, learned=True))
        out = kernels.attention(q, k, v, bias=bias, mask=None if backend == "cudnn" else mask,
                                causal=True, structure=structure, backend=backend)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    result, grads = {}, {}
    for backend in ("reference", "flex", "cudnn"):
        # cuDNN: the timing only (its learned-bias gradient is what bias_gradient checks).
        grad_fn = jax.jit(jax.grad(functools.partial(loss, backend=backend), (0, 1, 2, 3)))
        try:
            grads[backend] = grad_fn(q, k, v, table)
            result[f"{backend}_fwd_bwd_ms"] = 1e3 * timed(lambda f=grad_fn: f(q, k, v, table))
        except Exception as error:  # noqa: BLE001 - report what ran
            result[f"{backend}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    if "flex" in grads:
        for name, want, got in zip(("q", "k", "v", "table"), jax.tree.leaves(grads["reference"]),
                                   jax.tree.leaves(grads["flex"]), strict=True):
            want, got = want.astype(jnp.float32), got.astype(jnp.float32)
            result[f"grad_{name}_max_abs_diff"] = float(jnp.max(jnp.abs(want - got)))
            result[f"grad_{name}_max_abs"] = float(jnp.max(jnp.abs(want)))
        result["flex_gradients_right"] = all(
            result[f"grad_{name}_max_abs_diff"] <= 0.05 * max(result[f"grad_{name}_max_abs"], 1e-6)
            for name in ("q", "k", "v", "table"))
    return result


def gpt2_small(**changes) -> ModelConfig:
    values = dict(vocab_size=50257, d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=0,
                  num_decoder_layers=12, dropout_rate=0.0, position_scheme="learned",
                  max_len=1024, norm_placement="pre", activation="gelu", use_bias=True,
                  scale_embeddings=False, embedding_init_stddev=0.02, dtype="bfloat16",
                  attention_backend="cudnn", scan_layers=True)
    return ModelConfig(**{**values, **changes})


def train_mfu(batch: int = 16, seq_len: int = 1024, steps: int = 10) -> dict:
    config = gpt2_small()
    model = DecoderLM(config)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (batch, seq_len), 0, config.vocab_size)
    params = jax.jit(lambda: jax.tree.map(
        lambda x: getattr(x, "value", x), model.init(jax.random.PRNGKey(1), tokens[:1])["params"],
        is_leaf=lambda x: hasattr(x, "value")))()
    optimizer = optax.adamw(3e-4, weight_decay=0.1)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        def loss_fn(params):
            logits = model.apply({"params": params}, tokens[:, :-1])
            sums = losses.cross_entropy(logits, tokens[:, 1:], jnp.ones(tokens[:, 1:].shape))
            return sums["loss_sum"] / sums["weight_sum"]
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tokens = jnp.concatenate([tokens, tokens[:, :1]], axis=1)  # seq_len inputs + 1 target
    params, opt_state, loss = step(params, opt_state, tokens)
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, tokens)
    jax.block_until_ready(loss)
    step_s = (time.perf_counter() - start) / steps
    tokens_per_s = batch * seq_len / step_s
    per_token = flops.flops_per_token(config, seq_len, "lm")
    peak = hardware.device_peak_flops(jax.devices()[0])
    return {"batch": batch, "seq_len": seq_len, "step_s": step_s, "tokens_per_s": tokens_per_s,
            "flops_per_token": per_token, "peak_flops": peak, "loss": float(loss),
            "mfu": tokens_per_s * per_token / peak if peak else None}


def hbm_bandwidth() -> float:
    data = jnp.ones((1024 * 1024 * 1024,), jnp.bfloat16)  # 2 GiB
    copy = jax.jit(lambda x: x + 1)
    seconds = timed(lambda: copy(data), repeats=5)
    return 2 * data.nbytes / seconds  # read + write


def decode_bound(new_tokens: int = 256) -> dict:
    config = gpt2_small(attention_backend="xla", param_dtype="bfloat16", scan_layers=False,
                        max_len=8 + new_tokens)
    params = jax.jit(lambda: jax.tree.map(
        lambda x: getattr(x, "value", x),
        DecoderLM(config).init(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))["params"],
        is_leaf=lambda x: hasattr(x, "value")))()
    prompts = np.random.default_rng(0).integers(3, 1000, (1, 8))
    run = lambda: lm_generate(params, config, prompts, np.array([8]), max_new_tokens=new_tokens,
                              eos_id=2).tokens
    seconds = timed(run, repeats=3)
    tokens_per_s = new_tokens / seconds
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    bandwidth = hbm_bandwidth()
    bound = bandwidth / weight_bytes
    return {"new_tokens": new_tokens, "tokens_per_s": tokens_per_s, "weight_bytes": weight_bytes,
            "hbm_bytes_per_s": bandwidth, "bound_tokens_per_s": bound,
            "fraction_of_bound": tokens_per_s / bound}


def main() -> None:
    device = jax.devices()[0]
    result = {"device": device.device_kind, "jax": jax.__version__}
    for name, fn in (("attention", attention_check), ("bias_gradient", bias_gradient_check),
                     ("flex", flex_check), ("train", train_mfu),
                     ("decode", decode_bound)):
        try:
            result[name] = fn()
        except Exception as error:  # report every part even if one fails
            result[name] = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
        print(name, json.dumps(result[name]), flush=True)
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
