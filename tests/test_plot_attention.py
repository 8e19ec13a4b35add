"""experiments/plot_attention.py: the recorded attention weights are the model's own (rows sum to
one, causal, the output unchanged), one record per attention call named by its module; the
position pictures are written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tfm.nn.config import ModelConfig
from tfm.nn.models import EncoderDecoder

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "plot_attention.py"
spec = importlib.util.spec_from_file_location("plot_attention", SCRIPT)
plot_attention = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_attention)


def test_recorded_attention_is_the_models(tmp_path):
    config = ModelConfig(vocab_size=16, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                         num_decoder_layers=2, position_scheme="alibi",
                         attention_backend="xla")
    model = EncoderDecoder(config)
    source, target = jnp.array([[3, 4, 5, 6, 2]]), jnp.array([[1, 7, 8]])
    params = jax.jit(model.init)(jax.random.PRNGKey(0), source, target)
    plain = jax.jit(model.apply)(params, source, target)
    with plot_attention.recorded_attention():  # the model's output is unchanged
        recorded = jax.jit(model.apply)(params, source, target)
    np.testing.assert_allclose(recorded, plain, atol=1e-5)
    records = plot_attention.attention_weights(model, params, source, target)
    paths = [path for path, _ in records]
    assert len(paths) == 1 + 2 * 2 and paths[0].startswith("encoder")
    assert [plot_attention._kind(p) for p in paths] == ["encoder", "self", "cross", "self",
                                                        "cross"]
    shapes = [weights.shape for _, weights in records]
    assert shapes == [(1, 2, 5, 5), (1, 2, 3, 3), (1, 2, 3, 5), (1, 2, 3, 3), (1, 2, 3, 5)]
    for _, weights in records:
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    decoder_self = records[1][1][0, 0]
    assert np.all(np.triu(decoder_self, 1) == 0)  # causal
    labels = {"encoder": (list("abcde"), list("abcde")), "self": (list("xyz"), list("xyz")),
              "cross": (list("xyz"), list("abcde"))}
    plot_attention.plot_attention_maps(records, labels, "tiny", tmp_path / "maps.png")
    assert (tmp_path / "maps.png").read_bytes()[:4] == b"\x89PNG"


def test_position_pictures(tmp_path):
    written = plot_attention.plot_positions(tmp_path, length=16, d_model=16, num_heads=4)
    assert [p.name for p in written] == [
        "positions_sinusoidal_similarity.png", "positions_alibi.png",
        "positions_t5_buckets_causal.png", "positions_t5_buckets_bidirectional.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)
