"""Evaluation: loss, perplexity and accuracy on the eval splits, and the generation metrics
(exact match, BLEU) of decoded outputs; `./launch.sh eval` and `./launch.sh generate`.

Decoding options travel as one `tfm.decode.search.DecodeConfig`, built from the config's `eval` or
`generate` section (see tfm/training/config.py) and passed unchanged to tfm.decode.generate.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from tfm.data import tokenizers
from tfm.decode import generate
from tfm.decode.search import DecodeConfig
from tfm.kernels import cpu_compile
from tfm.parallel import sharding
from tfm.training import long_context, losses, metrics
from tfm.training.experiment import Experiment, setup
from tfm.training.losses import loss_sums
from tfm.training.state import InShardingContext, restore_params, state_shardings

logger = logging.getLogger("tfm.training.train")  # the training system's one log name


class PromptError(ValueError):
    """A generation prompt the model cannot take (characters outside the vocabulary, too long)."""


def eval_step(
    params: Any, batch: Mapping[str, jax.Array], *, model: Any, mode: str
) -> dict[str, jax.Array]:
    """Loss sums over the real tokens of a batch (unsmoothed: eval reports the true NLL)."""
    weights = batch["weights"] * batch["example_weights"][:, None]
    return loss_sums(model, params, batch, weights, mode=mode, deterministic=True)


def jit_eval_step(experiment: Experiment, param_shardings: Any) -> InShardingContext:
    """`eval_step` jit-compiled: params placed as `param_shardings`, batches split over the
    "batch" rule's mesh axes, loss sums replicated. `eval(params, batch) -> loss sums`."""
    mesh = experiment.mesh
    jitted = cpu_compile.jit(
        functools.partial(eval_step, model=experiment.model, mode=experiment.mode),
        cpu_kernels=cpu_compile.resolve_cpu_kernels(
            "auto", experiment.model_config.compute_dtype
        ),
        in_shardings=(param_shardings, sharding.batch_sharding(mesh, experiment.rules)),
        out_shardings=sharding.replicated(mesh),
        platform=experiment.platform,
    )
    return InShardingContext(jitted, experiment)


def evaluate(experiment: Experiment, params: Any, eval_fn: Callable | None = None) -> dict:
    """Loss/perplexity/accuracy on every eval split, plus exact match or BLEU from decoding,
    and the long-context probes the eval section turns on (tfm.training.long_context)."""
    options = experiment.eval
    eval_fn = eval_fn or jit_eval_step(experiment, state_shardings(experiment)[1].params)
    metric = experiment.generation_metric
    results: dict[str, float] = {}
    for split in experiment.eval_splits:
        totals: dict[str, float] = {}
        for index, batch in enumerate(experiment.data.eval_batches(split)):
            if options.max_batches and index >= options.max_batches:
                break
            global_batch = sharding.shard_batch(
                dict(batch), experiment.mesh, rules=experiment.rules
            )
            for key, value in jax.device_get(eval_fn(params, global_batch)).items():
                totals[key] = totals.get(key, 0.0) + float(value)
        prefix = experiment.eval_prefix(split)
        for key, value in losses.weighted_metrics(totals).items():
            if key in ("nll", "perplexity", "accuracy"):
                name = {"nll": "loss"}.get(key, key)
                results[f"{prefix}_{name}"] = float(value)
        if metric != "none":
            results[f"{prefix}_{metric}"] = generation_score(experiment, params, split, metric)
        results.update(long_context.position_perplexity(experiment, params, split))
    results.update(long_context.passkey_scores(experiment, params, decode_texts))
    return results


def decode_texts(
    experiment: Experiment,
    params: Any,
    sources: list[str],
    decode: DecodeConfig,
    *,
    rng: jax.Array | None = None,
    progress: str | None = None,
) -> list[str]:
    """Generates a target text for each source text (prompt for an LM, source for seq2seq), as
    `decode` says. `progress`: a label for a progress bar over the batches (process 0)."""
    config = experiment.model_config
    encoded = [experiment.data.encode_prompt(text) for text in sources]
    batch_size = experiment.data.config.eval_batch_size or experiment.data.config.batch_size
    width = max(len(ids) for ids in encoded)
    run, _ = generate.GENERATORS[experiment.family.generator]
    special = generate.special_ids(experiment.data.tokenizer, experiment.mode)
    outputs: list[str] = []
    bar = metrics.progress_bar(
        -(-len(encoded) // batch_size), desc=progress or "", unit="batch", leave=False,
        enabled=progress is not None and jax.process_index() == 0,
    )
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - real)  # fixed shapes: one compilation
        tokens, lengths = generate.pad_batch(chunk)
        tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
        output = run(params, config, tokens, lengths, decode, rng=rng, **special)
        best, _ = generate.best_sequences(jax.tree.map(_fetch, output))
        outputs += [experiment.data.decode(row) for row in best[:real]]
        bar.update(1)
    bar.close()
    return outputs


def _fetch(x: jax.Array) -> np.ndarray:
    """The whole value of an output array on this host, also when other processes hold parts."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def generation_score(experiment: Experiment, params: Any, split: str, metric: str) -> float:
    """Exact-match accuracy (percent) or corpus BLEU of decoded outputs on `split`."""
    sources, targets = experiment.generation_examples(split)
    decode = experiment.eval.decode_config(metric)
    if not experiment.family.reads_source:  # room for the longest target, its eos and one more
        new_tokens = max(len(experiment.data.tokenizer.encode(t)) for t in targets) + 2
        decode = dataclasses.replace(decode, max_new_tokens=new_tokens)
    hypotheses = decode_texts(
        experiment, params, sources, decode,
        progress=f"decode {split}" if experiment.train.progress_bar else None,
    )
    if metric == "exact_match":
        return 100.0 * float(np.mean([h == t for h, t in zip(hypotheses, targets, strict=True)]))
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hypotheses, [targets]).score)


def evaluate_checkpoint(
    config: ml_collections.ConfigDict, workdir: str | Path, step: int | None = None
) -> dict[str, float]:
    """`./launch.sh eval`: metrics on the eval splits from the latest (or given) checkpoint."""
    experiment = setup(config, workdir)
    params, step = restore_params(experiment, step)
    results = evaluate(experiment, params)
    results["step"] = step
    return results


def generate_from_checkpoint(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    prompts: list[str],
    step: int | None = None,
) -> list[str]:
    """`./launch.sh generate`: text in, text out, with the config's `generate` settings."""
    experiment = setup(config, workdir)
    options = experiment.generate
    check_prompts(experiment, prompts, map_unknown=options.map_unknown)
    params, _ = restore_params(experiment, step)
    rng = jax.random.PRNGKey(options.seed) if options.decode.method == "sample" else None
    decode = options.decode_config(experiment.mode)
    return decode_texts(experiment, params, prompts, decode, rng=rng)


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def check_prompts(experiment: Experiment, prompts: Sequence[str], *, map_unknown: bool) -> None:
    """Before restoring or compiling anything: raises PromptError (one line) for characters
    outside the vocabulary (unless `map_unknown`) and for prompts past a learned position
    table; warns (one line, any scheme) when generation runs past the trained rows: an LM's
    prompt + max_new_tokens past data.seq_len, a translation's source past its training rows."""
    data, config = experiment.data, experiment.model_config
    reads_source = experiment.family.reads_source  # prompts are sources (else a prefix)
    decode = experiment.generate.decode_config(experiment.mode)
    max_new = experiment.generate.decode.max_new_tokens
    tokenizer = (data.source_tokenizer or data.tokenizer) if reads_source else data.tokenizer
    for number, prompt in enumerate(prompts, 1):
        unknown = tokenizers.unknown_characters(tokenizer, prompt)
        if unknown and not map_unknown:
            alphabet = getattr(tokenizer, "chars", None)
            known = (f" (the vocabulary: {''.join(alphabet)!r})"
                     if alphabet is not None and len(alphabet) <= 64 else "")
            raise PromptError(
                f"prompt {number} {_short(prompt)} has characters outside the vocabulary: "
                f"{', '.join(repr(c) for c in unknown)}{known}; remove them, or pass "
                "--config.generate.map_unknown=True to map them to <unk>"
            )
    widths = [len(data.encode_prompt(prompt)) for prompt in prompts]
    width, longest = max(widths), prompts[widths.index(max(widths))]
    number = widths.index(width) + 1
    beam = decode.method == "beam"
    if reads_source:
        extra = decode.extra_len  # beam search: at most source length + extra_len tokens
        needs = {"source": width, "output": (width + extra if beam else max_new) + 1}
        trained = data.train_lengths["source"]
    else:
        needs = {"prompt and output": width + max_new}
        trained = data.train_lengths["inputs"]
    if config.scheme.bounded_by_max_len:
        for what, length in needs.items():
            if length > config.max_len:
                raise PromptError(
                    f"prompt {number} {_short(longest)} is {width} tokens; its "
                    f"{what} needs {length} positions, past model.max_len={config.max_len} of "
                    "the learned position table; shorten the prompt"
                    + ("" if reads_source and beam else " or lower generate.max_new_tokens")
                )
    if reads_source:
        if width > trained:
            reach = ("has positions up to model.max_len, but those past the trained lengths "
                     "were never trained" if config.scheme.bounded_by_max_len else
                     "runs at any length, but quality past the trained lengths may drop")
            logger.warning(
                "prompt %d %s is %d tokens, longer than the %d of the training rows; "
                "position_scheme=%r %s", number, _short(longest), width, trained,
                config.position_scheme, reach,
            )
        return
    if width + max_new > trained:
        past = min(max_new, width + max_new - trained)  # the generated tokens past the rows
        logger.warning(
            "generating %d tokens past the trained context of %d (data.seq_len): prompt %d %s "
            "is %d tokens + generate.max_new_tokens=%d; quality may degrade (position_scheme=%r)",
            past, trained, number, _short(longest), width, max_new, config.position_scheme,
        )
