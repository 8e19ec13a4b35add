"""The context-extension study: how position schemes carry a model trained at 256 tokens to
longer contexts, zero-shot and after a short fine-tune (experiments/context_extension.py runs it;
results in experiments/results/context_extension/).

A character-level decoder (3 layers, d_model 64, 4 heads) trained on contiguous tinyshakespeare
windows of 256 characters with passkey-retrieval rows mixed in (data.passkey_rows: a key hidden
in filler text, asked for at the end), so one model has both a perplexity and a retrieval score
at every length. Every scheme trains from the same data in the same order:

    ./launch.sh train configs/context_extension.py:rope --workdir workdirs/ce/rope_seed0
    ./launch.sh sweep configs/context_extension.py --seeds 0,1,2      # every scheme of SCHEMES

Variants: a position scheme (rope, alibi, t5_bias, fire, kerple_log, none), `runlocal`.
RoPE's scalings (linear, ntk, dynamic, yarn) are evaluation-time fields (checkpoint.EVAL_TIME) of
the RoPE model, and its fine-tunes start from its checkpoint (init.checkpoint) at 2x and 4x the
length with FINETUNE_STEPS (5% of PRETRAIN_STEPS) at the same tokens per step.
"""

from configs.base import apply_variants, base_config
from tfm.data import ASSETS

TRAIN_LENGTH = 256
PRETRAIN_STEPS = 600
FINETUNE_STEPS = PRETRAIN_STEPS // 20
TOKENS_PER_STEP = 8 * TRAIN_LENGTH
PASSKEY_ROWS = 2000  # about a third of the training rows (the text gives ~3,900 windows of 256)
SCHEMES = ("rope", "alibi", "t5_bias", "fire", "kerple_log", "none")


def get_config(arg: str | None = None):
    config = base_config()
    config.data.update(
        kind="text", path=str(ASSETS / "tinyshakespeare.txt"), tokenizer="char",
        text_unit="block", seq_len=TRAIN_LENGTH, batch_size=TOKENS_PER_STEP // TRAIN_LENGTH,
        eval_seq_len=TRAIN_LENGTH, eval_batch_size=8, passkey_rows=PASSKEY_ROWS,
    )
    config.model.update(
        d_model=64, num_heads=4, d_ff=256, num_encoder_layers=0, num_decoder_layers=3,
        dropout_rate=0.0, position_scheme="rope", norm_placement="pre", activation="gelu",
        max_len=4096, scale_embeddings=False, embedding_init_stddev=0.02,
        rope_original_max_len=TRAIN_LENGTH,
    )
    config.optimizer.update(name="adamw", schedule="cosine", learning_rate=2e-3,
                            warmup_steps=PRETRAIN_STEPS // 20, weight_decay=0.1,
                            grad_clip_norm=1.0)
    config.train.update(num_steps=PRETRAIN_STEPS, log_every=PRETRAIN_STEPS // 6,
                        eval_every=PRETRAIN_STEPS, checkpoint_every=PRETRAIN_STEPS)
    # Rows of L tokens hold a prompt of L - 7 (the key and its space follow).
    config.eval.update(max_batches=4, passkey_lengths=(TRAIN_LENGTH - 7,), passkey_examples=4)

    def runlocal(c):
        c.data.passkey_rows = 200
        c.optimizer.warmup_steps = 2
        c.train.update(num_steps=20, log_every=10, eval_every=20, checkpoint_every=20)
        c.eval.update(max_batches=1, passkey_examples=1, passkey_depths=(0.5,))

    apply_variants(config, arg, {"runlocal": runlocal})  # a scheme's name is a variant too
    return config


def get_sweep(arg: str | None = None):
    """The pretraining runs: every scheme of SCHEMES (or those named in ARG)."""
    from tfm.sweeps.sweep import sweep

    names = set(filter(None, (arg or "").split(",")))
    return sweep("model.position_scheme", [s for s in SCHEMES if s in names] or list(SCHEMES))
