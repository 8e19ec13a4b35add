"""tfm models in EleutherAI's lm-evaluation-harness (`pip install -e ".[eval]"`).

The harness's model `tfm`, built from a training run or a Hugging Face folder:

    lm_eval.simple_evaluate(model="tfm", model_args="workdir=workdirs/char_lm", tasks=[...])
    lm_eval.simple_evaluate(model="tfm", model_args="pretrained=/models/gpt2", tasks=[...])
    ./launch.sh lm_eval --workdir workdirs/char_lm --tasks lambada_openai --limit 100
    tfm-lm-eval --model tfm --model_args workdir=W --tasks hellaswag

The last is the harness's own command line with `tfm` registered (also `python -m
tfm.interop.lm_eval`): lm-eval 0.4.13's registry can hold entry points but never looks any up,
so its `lm_eval --model tfm` cannot find a model of another package. Importing this package
registers the model.

Conventions are the harness's `hf` model's: a (context, continuation) pair is encoded whole and
split, trailing spaces of the context moving to the continuation; the last continuation token is
never fed to the model; rows keep the last `max_length + 1` tokens; documents are scored in
rolling windows of `max_length` tokens (`lm_eval.utils.get_rolling_token_windows` with
context_len=1, made disjoint); generation keeps the last `max_length - max_gen_toks` prompt
tokens and is cut at the first stop string. The prefix token (an empty context, the first window
of a document) is the tokenizer's bos. A tfm run's rows start with bos, so every context starts
with it too (`add_bos=True`, the default for a workdir); a Hugging Face folder gets it only for an
empty context, as `hf` does (`add_bos=False`).

Rows are batched by length (longest first, as the harness's own models) into fixed-size batches
whose width is rounded up to a power of two (few compilations); each row carries its length, and
only positions below it are attended to and scored: validity is data, never a padding id.

Model arguments: workdir=W | pretrained=DIR, step=N (a workdir's checkpoint; default latest),
max_length=N (default: a run's training row length, data.seq_len, or a folder's
model.max_len), batch_size=N (default 16; rounded up to a multiple of the run's data-parallel
devices, over which each scoring batch is split), add_bos=true|false.

Several processes (a run on several hosts: `./launch.sh lm_eval --num_processes N`, SLURM, a TPU
pod), as Levanter does it: process 0 runs the harness; each batch it would run is broadcast to
the other processes (`hosts.share`), and every process runs the same jitted step on the run's
mesh. Generation runs with the run's params where they are, its batch replicated.
"""

from tfm.interop.lm_eval.model import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_GEN_TOKS,
    TfmLM,
    batch_shards,
    evaluate,
    load_folder,
    load_run,
)
from tfm.interop.lm_eval.rows import (
    MIN_WIDTH,
    ScoringRow,
    bucket_width,
    cut_at_stop,
    length_batches,
    pad_rows,
    rolling_windows,
    score_from_logits,
    score_rows,
    scored_positions,
    scoring_row,
)

__all__ = [
    "DEFAULT_BATCH_SIZE", "DEFAULT_MAX_GEN_TOKS", "MIN_WIDTH", "ScoringRow", "TfmLM",
    "batch_shards", "bucket_width", "cut_at_stop", "evaluate", "length_batches", "load_folder",
    "load_run", "pad_rows", "rolling_windows", "score_from_logits", "score_rows",
    "scored_positions", "scoring_row",
]
