"""The char-GPT benchmark shape on tfm's side, shared by vs_torch.py, dropout_cost.py and
xla_options.py: its ModelConfig, a random batch, and tfm's jitted train step on it.

The shape (issue 9's anchor): 6 layers, 6 heads, d_model 384, block 256, batch 64, dropout 0.2,
learned positions, pre-LN, GELU, no biases, tied output, AdamW. Needs no torch.
"""

from __future__ import annotations

import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tfm.kernels import cpu_compile
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM
from tfm.training import train
from tfm.training.experiment import TrainState

VOCAB = 65
SHAPE = types.SimpleNamespace(layers=6, heads=6, d_model=384, block=256, batch=64, dropout=0.2)


def model_config(shape, dtype: str, max_len: int) -> ModelConfig:
    """`shape`: any object with layers, heads, d_model and dropout (SHAPE, parsed args)."""
    return ModelConfig(
        vocab_size=VOCAB, d_model=shape.d_model, num_heads=shape.heads, d_ff=4 * shape.d_model,
        num_encoder_layers=0, num_decoder_layers=shape.layers, dropout_rate=shape.dropout,
        position_scheme="learned", max_len=max_len, norm_placement="pre", activation="gelu",
        use_bias=False, scale_embeddings=False, dtype=dtype,
    )


def random_batch(batch: int, block: int, seed: int = 0) -> tuple[dict, np.ndarray, np.ndarray]:
    """(tfm batch dict, inputs, targets): uniform random tokens, every position real."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, VOCAB, (batch, block)).astype(np.int32)
    targets = rng.integers(0, VOCAB, (batch, block)).astype(np.int32)
    positions = np.broadcast_to(np.arange(block, dtype=np.int32), inputs.shape)
    tfm_batch = {
        "inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets),
        "weights": jnp.ones(inputs.shape, jnp.float32), "positions": jnp.asarray(positions),
        "segment_ids": jnp.ones(inputs.shape, jnp.int32),
    }
    return tfm_batch, inputs, targets


def init_params(config: ModelConfig, prompt_len: int = 1):
    """DecoderLM params from PRNGKey(0), unboxed."""
    prompt = jnp.ones((1, prompt_len), jnp.int32)
    boxed = DecoderLM(config).init(jax.random.PRNGKey(0), prompt)["params"]
    return jax.tree.map(lambda x: getattr(x, "value", x), boxed,
                        is_leaf=lambda x: hasattr(x, "value"))


def tfm_train_runner(shape, dtype: str, batch: dict, dropout_rng: str = "threefry",
                     microbatches: int = 1, devices: int = 1, cpu_kernels: str = "auto"):
    """tfm's train step as `train.jit_steps` compiles it (`cpu_kernels` as train.cpu_kernels),
    the batch split over `devices` CPU devices (a "data" mesh axis; params and optimizer state
    replicated). Compiles (with the options in force: see cpu_compile.using) and warms up;
    returns (run, config, compile seconds), run(steps) -> seconds for `steps` steps."""
    config = model_config(shape, dtype, shape.block)
    model = DecoderLM(config)
    optimizer = optax.adamw(1e-3, b1=0.9, b2=0.99, weight_decay=0.1)
    params = init_params(config)
    state = TrainState(
        jnp.zeros((), jnp.int32), params, optimizer.init(params), jax.random.PRNGKey(1)
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    state, batch = jax.device_put(state, replicated), jax.device_put(batch, split)
    step = cpu_compile.jit(
        lambda s, b: train.train_step(
            s, b, model=model, mode="lm", optimizer=optimizer,
            schedule=optax.constant_schedule(1e-3), label_smoothing=0.0,
            dropout_rng_impl=dropout_rng, microbatches=microbatches,
        ),
        cpu_kernels=cpu_compile.resolve_cpu_kernels(cpu_kernels, config.compute_dtype),
        in_shardings=(replicated, split), out_shardings=(replicated, replicated),
        donate_argnums=(0,),
    )
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    holder = {"state": state}

    def run(steps: int) -> float:
        begin = time.perf_counter()
        for _ in range(steps):
            holder["state"], metrics = compiled(holder["state"], batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - begin

    run(1)  # warm up
    return run, config, compile_s
