"""Decoder-only LM on a synthetic task: prompt, separator, answer; loss on the answer only.

    ./launch.sh train configs/synthetic_lm.py:reverse,alibi
    ./launch.sh generate configs/synthetic_lm.py:reverse,alibi --prompt 12345

The position-scheme sweep (experiments/position_sweep.py) trains this config once per
scheme and compares exact match on "validation" (training lengths 1-12) and "test" (13-24).
Variants: a task (copy, reverse, sort, addition), a position scheme, `runlocal`.
"""

from configs.base import apply_variants, synthetic_config, synthetic_variants


def get_config(arg: str | None = None):
    config = synthetic_config("lm", seq_len=64, num_steps=2000)
    config.model.update(num_encoder_layers=0, num_decoder_layers=3, position_scheme="rope")
    config.eval.max_generation_examples = 256
    apply_variants(config, arg, synthetic_variants())
    return config
