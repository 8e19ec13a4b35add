"""Character-level decoder-only LM on a text file (tinyshakespeare by default).

    ./launch.sh train configs/char_lm.py
    ./launch.sh train configs/char_lm.py:runlocal              # a 1-minute smoke run
    ./launch.sh train configs/char_lm.py:rope --config.data.path=/my/corpus.txt
    ./launch.sh generate configs/char_lm.py --prompt "ROMEO:" --config.generate.method=sample

Variants: a position scheme, `bf16` (bfloat16 compute), `runlocal`, `small` (nanoGPT's
small CPU recipe, 2,000 steps; compare with benchmarks/vs_torch.py's anchor). The text is split into
paragraphs; the last 10% (deterministic) is the validation split. Expected result (measured
on a shared 2-core CPU, 33 min): eval_loss 1.985 / 1.832 / 1.798 nats per character at steps
200 / 400 / 600. Measure it again with
`python experiments/measure_quickstart.py --config configs/char_lm.py --prompt ROMEO:`
(writes experiments/results/char_lm.{json,md}).

Length extrapolation (Press et al. 2022, Fig. 1), the `extrapolation` variant: every position
scheme trained on contiguous text at context 128, each checkpoint then evaluated on every
non-overlapping window of 64 ... 1,024 characters of the contiguous validation text
(`get_sweep`; learned positions have max_len=128, so they are n/a past 128; position schemes
named in ARG keep just those):

    ./launch.sh sweep configs/char_lm.py:extrapolation --seeds 0,1,2 --parallel 2 \
        --eval_seq_len 64,128,256,512,1024
    ./launch.sh report workdirs/sweeps/char_lm_extrapolation --metrics eval_loss,eval_perplexity

Budget: EXTRAPOLATION_STEPS = 1,200 steps of 12 x 128 characters. A pilot (learned and alibi,
40 steps, shared 2-core AMD EPYC under a load of ~4) ran 2.7 steps/s, so about 7.5 minutes per
scheme there and about 4 on a quiet machine (the `small` recipe: 103 ms/step at half the context);
relative and t5_bias cost more per step. Measured in the 3-seed sweep, two runs at a time on
a shared 2-core AMD EPYC: 10-17 minutes a run, train and evaluations
(experiments/results/char_lm_extrapolation/).
"""

from configs.base import apply_variants, base_config, position_sweep
from tfm.data import ASSETS

EXTRAPOLATION_STEPS = 1200


def get_config(arg: str | None = None):
    config = base_config()
    config.data.kind = "text"
    config.data.path = str(ASSETS / "tinyshakespeare.txt")  # ships with the package
    config.data.tokenizer = "char"
    config.data.seq_len = 128
    config.data.batch_size = 32
    config.data.eval_seq_len = 128
    config.data.eval_batch_size = 64

    config.model.update(
        d_model=128, num_heads=4, d_ff=512, num_encoder_layers=0, num_decoder_layers=4,
        dropout_rate=0.1, position_scheme="rope", norm_placement="pre", activation="gelu",
        max_len=1024,
        # A tied output with the paper's sqrt(d_model) scaling and d_model^-0.5 init starts at
        # loss ~6.2 (the input character's own logit is large); these start at ln(65) = 4.17.
        scale_embeddings=False, embedding_init_stddev=0.02,
    )
    config.optimizer.update(name="adamw", schedule="cosine", learning_rate=2e-3,
                            warmup_steps=50, weight_decay=0.1,
                            grad_clip_norm=1.0)
    config.train.update(num_steps=600, log_every=50, eval_every=200, checkpoint_every=200,
                        keep_best_metric="eval_loss")
    config.eval.max_batches = 20
    config.generate.update(method="sample", max_new_tokens=200, temperature=0.8, top_k=20)

    def runlocal(c):
        c.model.update(d_model=64, d_ff=256, num_decoder_layers=2)
        c.data.seq_len = 64
        c.data.eval_seq_len = 64
        c.optimizer.warmup_steps = 10
        c.train.update(num_steps=100, log_every=25, eval_every=100, checkpoint_every=100)
        c.eval.max_batches = 4

    def bf16(c):
        c.model.dtype = "bfloat16"

    def small(c):
        """nanoGPT's small CPU recipe for this data: 4 layers, 4 heads, d_model 128, 64-char
        blocks, batch 12, 2,000 steps, no dropout, learned positions, no biases; AdamW (0.9,
        0.99), lr 1e-3 with 100 warmup steps and cosine to 1e-4, weight decay 0.1, clip 1.0.
        Eval covers every non-overlapping 64-char window of the validation split. Measured
        (`./launch.sh train configs/char_lm.py:small`, shared 2-core AMD EPYC): eval_loss 1.8014
        at step 2,000; about 49 ms/step in the loop, 2 min 0 s wall (60 ms/step and 2 min 21 s
        with TFM_MALLOC_DEFAULTS=0; later reruns: 40-48 ms/step, 1 min 38 s to 1 min 50 s). With
        `--devices_per_process 2`: the same eval_loss, 48 ms/step, 1 min 58 s. The jitted step
        alone: 48.0 ms, torch 54.4 ms (benchmarks/README.md)."""
        c.model.update(d_model=128, num_heads=4, d_ff=512, num_decoder_layers=4,
                       dropout_rate=0.0, position_scheme="learned", max_len=256, use_bias=False)
        c.data.update(seq_len=64, eval_seq_len=64, batch_size=12, eval_batch_size=256)
        c.optimizer.update(learning_rate=1e-3, warmup_steps=100, end_fraction=0.1, b1=0.9,
                           b2=0.99, weight_decay=0.1, grad_clip_norm=1.0)
        c.train.update(num_steps=2000, log_every=250, eval_every=1000, checkpoint_every=1000)
        c.eval.max_batches = 0
        c.generate.max_new_tokens = 100

    def extrapolation(c):
        """Train at context 128 on contiguous text (text_unit="block": windows run across
        paragraphs, as in Press et al.'s training) with the `small` recipe's model and
        optimizer, batch 12, EXTRAPOLATION_STEPS steps; evaluate every validation window
        (eval.max_batches=0). max_len=128 bounds only learned positions (n/a at longer eval
        lengths; generation stays within it)."""
        scheme = c.model.position_scheme  # `small` picks learned; keep the one chosen
        small(c)
        c.model.update(max_len=128, position_scheme=scheme)
        # Eval batch 8: at 1,024 tokens a reference-backend attention matrix is 128 MiB, and
        # Shaw's relative value term builds a [8, 1024, 1024, 33] one-hot (1.1 GiB).
        c.data.update(text_unit="block", seq_len=128, eval_seq_len=128, eval_batch_size=8)
        steps = EXTRAPOLATION_STEPS
        c.optimizer.warmup_steps = steps // 20
        c.train.update(num_steps=steps, log_every=steps // 10, eval_every=steps,
                       checkpoint_every=steps)

    apply_variants(config, arg, {"runlocal": runlocal, "bf16": bf16, "small": small,
                                 "extrapolation": extrapolation})
    return config


def get_sweep(arg: str | None = None):
    """Every position scheme (or those named in ARG), at the variant ARG
    (`./launch.sh sweep configs/char_lm.py:extrapolation`)."""
    return position_sweep(arg)
