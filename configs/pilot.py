"""Pilot: sinusoidal vs ALiBi positions on copy, trained on lengths 1-8, tested on 9-12.

The smallest sweep that shows a difference between position schemes: 4 runs of 600 steps, 2 at
a time: 2 min 17 s wall (261 s user CPU) on an idle 2-core AMD EPYC (6 min 15 s when the
machine was shared with other work, load average 4-6.6):

    ./launch.sh sweep configs/pilot.py --parallel 2
    ./launch.sh report workdirs/sweeps/pilot \
        --metrics eval_exact_match,eval_test_exact_match,eval_test_accuracy,eval_test_loss \
        --title "Pilot: copy, trained on lengths 1-8, tested on 9-12"

It should show (mean ± std over seeds 0 and 1; experiments/results/pilot/):

| scheme     | exact match, lengths 1-8 | exact match, 9-12 | token accuracy, 9-12 | loss, 9-12 |
|------------|-------------------------:|------------------:|---------------------:|-----------:|
| sinusoidal | 100 ± 0 %                | 1.2 ± 1.7 %       | 44.9 ± 0.1 %         | 2.97 ± 0.13 |
| alibi      | 100 ± 0 %                | 44.5 ± 11 %       | 91.9 ± 2.5 %         | 0.28 ± 0.09 |

Both learn the training lengths; past them sinusoidal positions fail and ALiBi copies about
half the longer strings (37% and 52% by seed; evaluated at steps 200, 400 and 600:
report_eval_test_exact_match.png, curves_eval_test_exact_match.png). NoPE lies between:
`./launch.sh sweep configs/pilot.py:sinusoidal,alibi,none --parallel 2` (6 runs, about 420
CPU-seconds; 9.0 ± 2.8% on 9-12 in an earlier try with 4 heads, where ALiBi had 35.6 ± 16%).
ARG names the schemes to sweep.
"""

from configs.base import apply_variants, synthetic_config, synthetic_variants

SCHEMES = ("sinusoidal", "alibi")
SEEDS = (0, 1)
STEPS = 600


def get_config(arg: str | None = None):
    config = synthetic_config("lm", seq_len=20, num_steps=STEPS)
    # Rows of 20 tokens hold the longest training example (8 + "=" + 8 + eos); eval rows fit
    # each split's longest example whatever seq_len says.
    config.data.update(task="copy", train_lengths=(1, 8), eval_lengths=(9, 12),
                       long_eval_lengths=None, num_train_examples=40_000,
                       num_eval_examples=128, batch_size=128)
    config.model.update(num_encoder_layers=0, num_decoder_layers=2, num_heads=8,
                        position_scheme="alibi")
    config.optimizer.warmup_steps = 30  # the cosine schedule spans train.num_steps
    config.train.update(num_steps=STEPS, log_every=100, eval_every=STEPS // 3,
                        checkpoint_every=STEPS,
                        # the second seed of a scheme loads its train and eval steps from here
                        compilation_cache_dir="workdirs/compilation_cache")
    config.eval.max_generation_examples = 128
    apply_variants(config, arg, synthetic_variants())
    return config


def get_sweep(arg: str | None = None):
    """Each scheme of SCHEMES, or those named in ARG (`configs/pilot.py:sinusoidal,alibi,none`),
    once per seed of SEEDS; seeds vary slowest, so that with `--parallel 2` a scheme's second
    seed starts once its first has compiled (and cached) its steps."""
    from tfm.nn.positions import POSITION_SCHEMES
    from tfm.sweeps.sweep import product, sweep

    named = [name for name in (arg or "").split(",") if name in POSITION_SCHEMES]
    return product(sweep("train.seed", SEEDS), sweep("model.position_scheme", named or SCHEMES))
