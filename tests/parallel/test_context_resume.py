"""Resuming across a change of mesh.context (issue 47): a tiny LM trained 2 steps with
context=4, resumed for 2 with context=1, then 2 more with context=4, against 6 uninterrupted
steps with context=4 on the 8 simulated CPU devices (tests/conftest.py)."""

import jax
import numpy as np
import pytest
from compile_cache import persistent_compilation_cache
from run_records import saved_state, train_losses

from configs import synthetic_lm
from tfm.training import train

NUM_STEPS, EVERY = 6, 2


@pytest.fixture(autouse=True)
def compilation_cache_dir(tmp_path_factory):
    """The three runs on context=4 compile their steps once."""
    with persistent_compilation_cache(tmp_path_factory.mktemp("jax_cache")):
        yield


def _config(data_dir, context, num_steps):
    config = synthetic_lm.get_config("runlocal")
    # No query, key or value biases: a key bias's gradient is zero but for rounding (it adds
    # the same to every logit of a query), and Adam turns rounding into steps of the learning
    # rate's size, so two meshes would leave it at values that differ without any effect.
    config.model.update(d_model=16, num_heads=4, num_kv_heads=2, d_ff=32, num_decoder_layers=1,
                        position_scheme="t5_bias", attention_backend="reference",
                        qkv_bias=False)
    config.data.update(batch_size=8, seq_len=16, packing=True, num_train_examples=100,
                       num_eval_examples=8, train_lengths=(1, 3), data_dir=str(data_dir))
    config.optimizer.update(total_steps=NUM_STEPS, warmup_steps=2)
    config.train.update(num_steps=num_steps, log_every=1, eval_every=NUM_STEPS,
                        checkpoint_every=EVERY, max_to_keep=None, keep_best_metric=None,
                        progress_bar=False)
    config.eval.update(splits=("validation",), generation_metric="none")  # loss only
    config.mesh.update({"data": -1, "context": context})  # data=2 x context=4, or data=8
    return config


def test_a_run_resumed_on_another_context_mesh_continues_the_uninterrupted_run(tmp_path):
    """Steps 1-2 (context=4) are bit for bit the uninterrupted run's, and the state restored
    from them is the one saved; steps 3-4 ran on context=1 and steps 5-6 on context=4 again,
    which sum the same terms in another order (the gradient's sum over tokens runs over
    other devices, the keys' gradients over all_gather's transpose), so from step 3 on losses
    and parameters equal the uninterrupted run's to float32 rounding: 1e-5 relative, not bit
    for bit. Every step is logged once."""
    data_dir, reference, workdir = tmp_path / "data", tmp_path / "reference", tmp_path / "run"
    train.train_and_evaluate(_config(data_dir, 4, NUM_STEPS), reference)
    for context, steps in ((4, 2), (1, 4), (4, 6)):
        train.train_and_evaluate(_config(data_dir, context, steps), workdir)
    want, got = train_losses(reference), train_losses(workdir)
    assert sorted(got) == list(range(1, NUM_STEPS + 1))
    assert [got[step] for step in (1, 2)] == [want[step] for step in (1, 2)]
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)],
                               rtol=1e-5)
    for step in (2, 4, NUM_STEPS):
        got_state, want_state = saved_state(workdir, step), saved_state(reference, step)
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got_state["params"]),
                                jax.tree.leaves(want_state["params"]), strict=True):
            if step == 2:
                np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step}: {jax.tree_util.keystr(path)}")
