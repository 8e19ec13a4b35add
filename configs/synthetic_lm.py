"""Decoder-only LM on a synthetic task: prompt, separator, answer; loss on the answer only.

    ./launch.sh train configs/synthetic_lm.py:reverse,alibi
    ./launch.sh generate configs/synthetic_lm.py:reverse,alibi --prompt 12345

The position-scheme sweep (experiments/length_generalization.py) trains this config once per
scheme and compares exact match on "validation" (training lengths 1-12) and "test" (13-24).
Variants: a task (copy, reverse, sort, addition), a position scheme, `runlocal`.
"""

from configs.base import apply_variants, base_config
from tfm.data.synthetic import TASKS


def get_config(arg: str | None = None):
    config = base_config()
    config.data.kind = "synthetic"
    config.data.mode = "lm"
    config.data.task = "reverse"
    config.data.train_lengths = (1, 12)
    config.data.eval_lengths = (13, 24)
    config.data.num_train_examples = 50_000
    config.data.num_eval_examples = 512
    config.data.seq_len = 64
    config.data.batch_size = 64
    config.data.eval_batch_size = 128
    config.data.packing = False

    config.model.update(
        d_model=64, num_heads=4, d_ff=256, num_encoder_layers=0, num_decoder_layers=3,
        dropout_rate=0.0, position_scheme="rope", norm_placement="pre",
    )
    config.optimizer.update(name="adamw", schedule="cosine", learning_rate=3e-3,
                            warmup_steps=100, total_steps=2000, grad_clip_norm=1.0)
    config.train.update(num_steps=2000, log_every=100, eval_every=1000, checkpoint_every=1000,
                        keep_best_metric="eval_exact_match", best_mode="max")
    config.eval.max_generation_examples = 256

    def runlocal(c):
        c.data.num_train_examples = 2_000
        c.data.num_eval_examples = 64
        c.optimizer.update(total_steps=60, warmup_steps=10)
        c.train.update(num_steps=60, log_every=20, eval_every=60, checkpoint_every=60)
        c.eval.max_generation_examples = 64

    variants = {"runlocal": runlocal}
    for task in TASKS:
        variants[task] = lambda c, task=task: setattr(c.data, "task", task)
    apply_variants(config, arg, variants)
    return config
