"""Tiny decoding models shared by tests/decode/test_generate.py and tests/nn/test_remat.py:
their config, prompts and numpy-initialised parameters (token ids: pad 0, bos 1, eos 2)."""

import flax.linen as nn
import jax
import numpy as np

from tfm.nn.config import ModelConfig

PAD, BOS, EOS = 0, 1, 2
TINY = dict(
    vocab_size=24,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,
    d_ff=32,
    num_encoder_layers=1,
    num_decoder_layers=2,
    dropout_rate=0.0,
    tie_output=False,
    max_len=16,
    relative_max_distance=3,
    t5_num_buckets=8,
    t5_max_distance=16,
)
# Prompts of different lengths, right-padded with pad.
PROMPTS = np.array([[1, 5, 6, 0, 0], [1, 7, 8, 9, 10], [1, 4, 0, 0, 0], [1, 0, 0, 0, 0]], np.int32)
PROMPT_LENGTHS = np.array([3, 5, 2, 1], np.int32)
MAX_NEW = 6
SOURCE = np.array([[5, 6, 7, 2, 0, 0], [8, 9, 10, 11, 12, 2], [4, 2, 0, 0, 0, 0]], np.int32)
EXTRA_LEN = 2  # translate's output budget per row: source length + EXTRA_LEN


def config_for(scheme: str, **changes) -> ModelConfig:
    return ModelConfig(**{**TINY, "position_scheme": scheme, **changes})


# With this seed every scheme's greedy paths vary, and a first token read at the padded last
# column instead of each row's own prompt end would differ on some row.
SEED = 2


def random_params(model: nn.Module, *inputs: np.ndarray, seed: int = SEED) -> dict:
    """N(0, 1/fan_in) kernels, N(0, 1) embeddings, position tables and output projection (its
    pad column zero), N(0, 0.01) biases, unit norm scales."""
    abstract = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)["params"])
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = path[-1].key
        if name == "scale":
            return np.ones(leaf.shape, np.float32)
        std = 1.0 / np.sqrt(leaf.shape[0]) if name == "kernel" else 1.0
        std = 0.1 if name == "bias" else std
        if path[-2].key == "output_projection":
            std = 1.0
        value = rng.normal(0.0, std, leaf.shape).astype(np.float32)
        if path[-2].key == "output_projection":
            value[:, PAD] = 0.0
        return value

    return jax.tree_util.tree_map_with_path(fill, abstract)
