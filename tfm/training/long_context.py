"""Long-context probes run with evaluation (both off by default; the `eval` section's fields):

- passkey retrieval (tfm.data.passkey): `eval.passkey_lengths` prompt lengths in tokens x
  `eval.passkey_depths`, `eval.passkey_examples` prompts per cell, decoded greedily; logged as
  `passkey/{task}_len{L}_depth{D}` (percent exact) and `passkey/{task}_len{L}` (their mean);
  the keys are also scored under teacher forcing: `passkey/{task}_len{L}_key_nll` (nats per
  key token) and `passkey/{task}_len{L}_key_chars` (percent of key tokens the model ranks
  first), graded where exact match is all or nothing (`eval.passkey_decode=False`: these
  alone, no decoding);
- perplexity by position: `eval.position_buckets` equal buckets of the eval rows' positions,
  logged as `{split}_ppl_pos{first}-{last}`: how a scheme's loss moves along a long row.

`check(experiment)` raises ConfigError for settings the model or tokenizer cannot run, before
anything compiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tfm.checks import ConfigError
from tfm.data import passkey, tokenizers
from tfm.decode.search import DecodeConfig
from tfm.parallel import sharding


def check(experiment: Any) -> None:
    """ConfigError (one line, naming the fields) for passkey settings the run cannot take."""
    options = experiment.eval
    if not options.passkey_lengths:
        return
    if experiment.family.reads_source:
        raise ConfigError("eval.passkey_lengths: passkey retrieval needs a decoder-only "
                          f"language model; this run's family is {experiment.mode!r}")
    config = experiment.model_config
    longest = max(options.passkey_lengths) + options.passkey_key_length + 2
    if config.scheme.bounded_by_max_len and longest > config.max_len:
        raise ConfigError(
            f"eval.passkey_lengths={list(options.passkey_lengths)} need {longest} positions, "
            f"past model.max_len={config.max_len} of position_scheme={config.position_scheme!r}"
        )
    make = lambda length: passkey.make_example(  # noqa: E731
        options.passkey_task, length, 0.5, 0, encode=experiment.data.tokenizer.encode,
        alphabet=options.passkey_alphabet, key_length=options.passkey_key_length)
    try:
        make(min(options.passkey_lengths))
    except ValueError as error:
        raise ConfigError(f"eval.passkey_lengths: {error}") from error
    sample = make(max(options.passkey_lengths))
    unknown = tokenizers.unknown_characters(experiment.data.tokenizer,
                                            sample.prompt + options.passkey_alphabet)
    if unknown:
        raise ConfigError(
            f"eval.passkey_lengths: the passkey prompts use characters outside the vocabulary "
            f"({', '.join(map(repr, unknown))}); train on text that has them, or set "
            "eval.passkey_alphabet to characters it has"
        )


def passkey_scores(experiment: Any, params: Any, decode_texts: Callable[..., list[str]]
                   ) -> dict[str, float]:
    """Exact-match percent per (length, depth) cell and per length. decode_texts(experiment,
    params, prompts, decode) -> texts (tfm.training.evaluate's, which calls this)."""
    options = experiment.eval
    if not options.passkey_lengths:
        return {}
    task = options.passkey_task
    decode = DecodeConfig("greedy", options.passkey_key_length + 2,
                          cache_segments=options.cache_segments,
                          prefill_chunk=options.prefill_chunk)
    results: dict[str, float] = {}
    for length in options.passkey_lengths:  # one width per decode: no padding to the longest
        examples = passkey.make_cells(
            task, [length], options.passkey_depths, options.passkey_examples,
            encode=experiment.data.tokenizer.encode, seed=experiment.data.config.seed,
            alphabet=options.passkey_alphabet, key_length=options.passkey_key_length)
        if options.passkey_decode:
            outputs = decode_texts(experiment, params, [e.prompt for e in examples], decode)
            cells = passkey.accuracy_by_cell(examples, outputs)
            for (_, depth), accuracy in cells.items():
                results[f"passkey/{task}_len{length}_depth{depth:g}"] = 100.0 * accuracy
            results[f"passkey/{task}_len{length}"] = 100.0 * float(np.mean(list(cells.values())))
        nll, hits = key_scores(experiment, params, examples)
        results[f"passkey/{task}_len{length}_key_nll"] = nll
        results[f"passkey/{task}_len{length}_key_chars"] = 100.0 * hits
    return results


def answer_rows(encoded: list[tuple[list[int], list[int]]], rows: int) -> dict[str, np.ndarray]:
    """A batch scoring each answer after its prompt: rows bos + prompt + answer (minus the last
    token) padded to the longest, weights on the answer's tokens only; rows past the examples
    are padding (weight 0), so every batch has the same number of rows.

    encoded: [(prompt ids with bos, answer ids)] -> {inputs, targets, weights, positions,
    segment_ids, example_weights}, each [rows, width] ([rows] for example_weights)."""
    width = max(len(prompt) + len(answer) - 1 for prompt, answer in encoded)
    batch = {key: np.zeros((rows, width), np.int32)
             for key in ("inputs", "targets", "positions", "segment_ids")}
    batch["weights"] = np.zeros((rows, width), np.float32)
    for row, (prompt, answer) in enumerate(encoded):
        ids = prompt + answer
        size = len(ids) - 1
        batch["inputs"][row, :size] = ids[:-1]
        batch["targets"][row, :size] = ids[1:]
        batch["positions"][row, :size] = np.arange(size)
        batch["segment_ids"][row, :size] = 1
        batch["weights"][row, len(prompt) - 1 : size] = 1.0
    batch["example_weights"] = np.ones(rows, np.float32)
    return batch


def answer_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(summed NLL, summed argmax hits, summed weight) of the weighted targets.

    logits: [B, T, V] float32; targets, weights: [B, T]."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return (jnp.sum((log_z - target_logit) * weights), jnp.sum(hits * weights),
            jnp.sum(weights))


def key_scores(experiment: Any, params: Any, examples: list[passkey.Example]
               ) -> tuple[float, float]:
    """The keys scored under teacher forcing, a graded measure where exact match is all or
    nothing: (NLL per key token in nats; chance is ln of the alphabet's size, fraction of key
    tokens that are the model's top choice). The answer's leading space counts as a key token.
    Batches of data.eval_batch_size rows."""
    family, model, data = experiment.family, experiment.model, experiment.data
    encoded = [(data.encode_prompt(e.prompt), data.tokenizer.encode(e.answer)) for e in examples]
    size = data.config.eval_batch_size or data.config.batch_size

    @jax.jit
    def sums(params, batch):
        logits = family.logits(model, params, batch, deterministic=True)
        return answer_sums(logits.astype(jnp.float32), batch["targets"], batch["weights"])

    totals = np.zeros(3)
    for start in range(0, len(encoded), size):
        batch = sharding.shard_batch(answer_rows(encoded[start : start + size], size),
                                     experiment.mesh, rules=experiment.rules)
        totals += np.asarray(jax.device_get(sums(params, batch)))
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def bucket_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                positions: jax.Array, buckets: int, width: int) -> tuple[jax.Array, jax.Array]:
    """Per position bucket, the summed NLL and weight of a batch.

    logits: [B, T, V] float32; targets, weights, positions: [B, T]; a token at position p
    falls in bucket p * buckets // width -> ([buckets], [buckets])."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = (log_z - target_logit) * weights
    index = jnp.clip(positions * buckets // width, 0, buckets - 1)
    one_hot = jax.nn.one_hot(index, buckets, dtype=jnp.float32)  # [B, T, buckets]
    return jnp.einsum("bt,btk->k", nll, one_hot), jnp.einsum("bt,btk->k", weights, one_hot)


def position_perplexity(experiment: Any, params: Any, split: str) -> dict[str, float]:
    """Perplexity per position bucket of `split`'s rows (eval.position_buckets of them)."""
    buckets = experiment.eval.position_buckets
    if not buckets:
        return {}
    family, model = experiment.family, experiment.model
    width = experiment.data.eval_lengths(split)["inputs"]

    @functools.partial(jax.jit, static_argnums=2)
    def sums(params, batch, width):
        logits = family.logits(model, params, batch, deterministic=True)
        weights = batch["weights"] * batch["example_weights"][:, None]
        return bucket_sums(logits.astype(jnp.float32), batch["targets"], weights,
                           batch["positions"], buckets, width)

    nll, count = np.zeros(buckets), np.zeros(buckets)
    for index, batch in enumerate(experiment.data.eval_batches(split)):
        if experiment.eval.max_batches and index >= experiment.eval.max_batches:
            break
        batch = sharding.shard_batch(dict(batch), experiment.mesh, rules=experiment.rules)
        batch_width = batch["inputs"].shape[1]
        got_nll, got_count = jax.device_get(sums(params, batch, max(width, batch_width)))
        nll, count = nll + got_nll, count + got_count
    size = -(-max(width, 1) // buckets)
    prefix = experiment.eval_prefix(split)
    return {f"{prefix}_ppl_pos{b * size}-{min((b + 1) * size, width) - 1}":
            float(np.exp(nll[b] / count[b])) for b in range(buckets) if count[b] > 0}
