"""The paper's Transformer for translation: German -> English on Multi30k by default.

    ./launch.sh data multi30k                           # once: the data, into data/multi30k/
    ./launch.sh train configs/translate.py              # paper base model (65M with 37k vocab)
    ./launch.sh train configs/translate.py:small        # a model sized for Multi30k on a CPU
    ./launch.sh train configs/translate.py:runlocal     # a minute-long smoke run
    ./launch.sh train configs/translate.py:wmt          # WMT14 En-De via the tfds catalog
    ./launch.sh average configs/translate.py --last_k 5 --output workdirs/translate_avg
    ./launch.sh generate configs/translate.py --prompt "Ein Mann fährt Fahrrad."

Paper settings: base model (N=6, d_model 512, d_ff 2048, h 8, dropout 0.1, shared embeddings),
Adam(0.9, 0.98, 1e-9) with the warmup-4000 inverse-sqrt schedule, label smoothing 0.1, beam 4,
alpha 0.6, max output = input + 50 (Vaswani et al. 2017 sec. 5-6). Evaluation reports
validation loss and sacreBLEU of beam-search translations (detokenized, beam 4). The base
model needs an accelerator; `runlocal` is a smoke test and learns only a little.

Measured on a 2-core AMD EPYC (results in experiments/results/, with their commands):
- `cpu_long`, the CPU recipe (d_model 128, 3+3 layers, 4k vocabulary, 3,000 steps, 39 min):
  validation BLEU 38.65, perplexity 5.34 at step 3,000 (multi30k_cpu/recipe_train.md; the
  learning curve in multi30k_cpu/README.md).
- Table 3 row (E), sinusoidal vs learned positions at the `cpu` budget (1,500 steps, 23 min a
  run, `get_sweep`): BLEU 35.75 vs 34.52, perplexity 6.76 vs 6.69 (translate_row_e/):

    ./launch.sh sweep configs/translate.py:cpu --seeds 0 --parallel 2
    ./launch.sh report workdirs/sweeps/translate_cpu --metrics eval_perplexity,eval_bleu

  Averaging the last 5 checkpoints (250 steps apart) lowered BLEU there, to 32.1 / 31.6
  (multi30k_cpu/averaged_last5_*.md): at 1,500 steps the model is still improving fast.
"""

from configs.base import apply_variants, base_config
from tfm.sweeps.sweep import sweep


def get_config(arg: str | None = None):
    config = base_config()
    config.data.kind = "parallel"
    # `./launch.sh data multi30k` puts the official files here (relative to the repository root).
    config.data.source_path = "data/multi30k/train.de.gz"
    config.data.target_path = "data/multi30k/train.en.gz"
    config.data.eval_source_path = "data/multi30k/val.de.gz"
    config.data.eval_target_path = "data/multi30k/val.en.gz"
    config.data.tokenizer = "sentencepiece"
    config.data.vocab_size = 8000
    config.data.shared_vocab = True
    config.data.seq_len = 64
    config.data.batch_size = 64
    # Packing applies to the training rows: Multi30k captions are short, so a row of 64 holds
    # 3.8 pairs on average with this 8k vocabulary (2.8 with runlocal's 1k; measured, and
    # tests/data/test_build.py checks that rows pack). Eval rows hold one pair each on purpose:
    # decoding and BLEU go example by example.
    config.data.packing = True

    config.model.update(
        d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6,
        dropout_rate=0.1, position_scheme="sinusoidal", norm_placement="post",
        activation="relu", share_embeddings=True, tie_output=True,
    )
    config.optimizer.update(name="adam_paper", warmup_steps=4000)
    config.train.update(num_steps=100_000, label_smoothing=0.1, log_every=100,
                        eval_every=5000, checkpoint_every=1000, max_to_keep=5,
                        keep_best_metric="eval_bleu", best_mode="max")
    # On CPU these encoder-decoder train steps ran faster with XLA's own kernels (YNNPACK) than
    # with tfm's default: 1.11x at the `cpu` recipe's shape, 1.04x at the base shape
    # (benchmarks/seq2seq_vs_torch.py; 2-core AMD EPYC; benchmarks/README.md). Decoding
    # keeps tfm's choice (1.14x faster in a scratch A/B). No effect off CPU.
    config.train.cpu_kernels = "ynnpack"
    config.eval.update(generation_metric="bleu", method="beam", beam_size=4, alpha=0.6,
                       extra_len=50, max_generation_examples=0)
    config.generate.update(method="beam", beam_size=4, alpha=0.6)

    def small(c):
        c.model.update(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
                       num_decoder_layers=3, dropout_rate=0.1)
        c.optimizer.update(warmup_steps=1000)
        c.train.update(num_steps=10_000, eval_every=2000, checkpoint_every=1000)

    def cpu(c):
        """Sized for a 2-core CPU in well under an hour: d_model 128, 3+3 layers, a 4k shared
        vocabulary, 32 packed rows (about 120 pairs) a step; one evaluation at the end."""
        c.model.update(d_model=128, num_heads=4, d_ff=512, num_encoder_layers=3,
                       num_decoder_layers=3, dropout_rate=0.1)
        c.data.update(vocab_size=4000, batch_size=32)
        c.optimizer.update(warmup_steps=400)
        c.train.update(num_steps=1500, eval_every=1500, checkpoint_every=250, max_to_keep=5)

    def cpu_long(c):
        """The Multi30k BLEU recipe on a CPU: `cpu` for 3,000 steps (12 epochs), BLEU every 500
        steps (the learning curve), a checkpoint every 100 steps, so `./launch.sh average
        --last_k 5` averages the last 400 steps, about the share of training the paper's last
        five checkpoints cover."""
        cpu(c)
        c.train.update(num_steps=3000, eval_every=500, checkpoint_every=100)

    def runlocal(c):
        small(c)
        c.model.update(d_model=64, d_ff=128, num_encoder_layers=1, num_decoder_layers=1)
        c.data.vocab_size = 1000
        c.data.batch_size = 16
        c.optimizer.update(warmup_steps=20)
        c.train.update(num_steps=40, log_every=10, eval_every=40, checkpoint_every=40)
        c.eval.update(max_batches=2, max_generation_examples=16, beam_size=2)

    def wmt(c):
        c.data.kind = "tfds"
        c.data.name = "wmt14_translate/de-en"
        c.data.features = {"source": "en", "target": "de"}
        c.data.download = True
        for field in ("source_path", "target_path", "eval_source_path", "eval_target_path"):
            c.data[field] = None
        c.data.vocab_size = 37000
        c.data.batch_size = 256
        c.train.update(num_steps=100_000, eval_every=10_000)

    variants = {"small": small, "cpu": cpu, "cpu_long": cpu_long, "runlocal": runlocal,
                "wmt": wmt}
    apply_variants(config, arg, variants)
    return config


def get_sweep(arg: str | None = None):
    """Table 3 row (E) of Vaswani et al. 2017: learned positions instead of sinusoids."""
    return sweep("model.position_scheme", ["sinusoidal", "learned"])
