"""Decoder-only LM on a synthetic task: prompt, separator, answer; loss on the answer only.

    ./launch.sh train configs/synthetic_lm.py:reverse,alibi
    ./launch.sh generate configs/synthetic_lm.py:reverse,alibi --prompt 12345

The position-scheme sweep trains this config once per scheme (and seed) and compares exact
match on "validation" (training lengths 1-12), "test" (13-24) and "test_long" (25-48):

    ./launch.sh sweep configs/synthetic_lm.py --seeds 0,1,2 --parallel 2   # 3 tasks x 7 schemes
    ./launch.sh report workdirs/sweeps/synthetic_lm \
        --metrics eval_exact_match,eval_test_exact_match,eval_test_long_exact_match

A task in the sweep's ARG keeps that task, schemes in it keep those schemes
(`configs/synthetic_lm.py:reverse,rope,alibi,runlocal`: a two-run pilot).
Variants: a task (copy, reverse, sort, addition), a position scheme, `runlocal`.
"""

from configs.base import apply_variants, synthetic_config, synthetic_sweep, synthetic_variants


def get_config(arg: str | None = None):
    config = synthetic_config("lm", seq_len=64, num_steps=2000)
    config.model.update(num_encoder_layers=0, num_decoder_layers=3, position_scheme="rope")
    config.eval.max_generation_examples = 256
    apply_variants(config, arg, synthetic_variants())
    return config


def get_sweep(arg: str | None = None):
    """`./launch.sh sweep configs/synthetic_lm.py[:ARG] --seeds 0,1,2`: every position scheme on the
    task in ARG, or on copy, reverse and addition (`configs.base.synthetic_sweep`)."""
    return synthetic_sweep(arg)
