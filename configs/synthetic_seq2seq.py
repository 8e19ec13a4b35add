"""Encoder-decoder on a synthetic task (reverse by default): the README quick start.

    ./launch.sh train configs/synthetic_seq2seq.py
    ./launch.sh generate configs/synthetic_seq2seq.py --prompt 3141592

Variants (comma-separated after the colon): a task (copy, reverse, sort, addition), a position
scheme (none, sinusoidal, learned, rope, relative, t5_bias, alibi), `runlocal` (a few steps).
Trains on lengths 1-12; "validation" holds unseen examples of those lengths, "test" lengths
13-24 and "test_long" 25-48 (length generalisation). Expected result
(experiments/measure_quickstart.py, results in experiments/results/quickstart.md, measured before
test_long existed, which adds its decoding to each evaluation; 3-4 minutes on a shared 2-core
CPU): eval_exact_match 95.9% at step 500 and 100% at step 1,000; eval_test_exact_match 2.1%
(sinusoidal positions do not generalise to longer strings). Every position scheme, on each
task, 3 seeds: `./launch.sh sweep configs/synthetic_seq2seq.py --seeds 0,1,2` (`get_sweep`;
schemes or a task in ARG keep just those).
"""

from configs.base import apply_variants, synthetic_config, synthetic_sweep, synthetic_variants


def get_config(arg: str | None = None):
    config = synthetic_config("seq2seq", seq_len=32, num_steps=1000)
    config.model.update(num_encoder_layers=2, num_decoder_layers=2, position_scheme="sinusoidal")
    config.eval.max_generation_examples = 512
    apply_variants(config, arg, synthetic_variants())
    return config


def get_sweep(arg: str | None = None):
    """`./launch.sh sweep configs/synthetic_seq2seq.py[:ARG] --seeds 0,1,2`: every position
    scheme on the task in ARG, or on copy, reverse and addition (`configs.base.synthetic_sweep`)."""
    return synthetic_sweep(arg)
