"""tfm models in EleutherAI's lm-evaluation-harness (`pip install -e ".[eval]"`).

The harness's model `tfm`, built from a training run or a Hugging Face folder:

    lm_eval.simple_evaluate(model="tfm", model_args="workdir=workdirs/char_lm", tasks=[...])
    lm_eval.simple_evaluate(model="tfm", model_args="pretrained=/models/gpt2", tasks=[...])
    ./launch.sh lm_eval --workdir workdirs/char_lm --tasks lambada_openai --limit 100
    python -m tfm.interop.lm_eval run --model tfm --model_args workdir=W --tasks hellaswag

(the last: the harness's own command line, with `tfm` registered; lm-eval 0.4.13 reads no
entry points, so `lm_eval --model tfm` alone does not find it). Importing this module registers
the model.

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
devices, over which each batch is split), add_bos=true|false.

Future work: one process only, and generation runs replicated on the run's mesh (scoring
batches are split over its data-parallel devices). Several hosts need Levanter's scheme
(process 0 runs the harness and broadcasts each batch; every process runs the step on the
mesh).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    from lm_eval import utils as harness_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as error:  # the eval extra is optional
    raise ImportError(
        'tfm.interop.lm_eval needs the lm-eval package: pip install -e ".[eval]"'
    ) from error

from tfm.decode.generate import lm_generate
from tfm.decode.search import DecodeConfig
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM

DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for generate_until
MIN_WIDTH = 8


# ------------------------------------------------------------------------- pure helpers


@dataclasses.dataclass(frozen=True)
class ScoringRow:
    """One row to score: `inputs` fed to the model, `targets` the next token at each input
    position (both [length]), the last `num_scored` targets being the continuation."""

    inputs: tuple[int, ...]
    targets: tuple[int, ...]
    num_scored: int


def scoring_row(
    context_ids: Sequence[int], continuation_ids: Sequence[int], max_length: int
) -> ScoringRow:
    """The row scoring `continuation_ids` after `context_ids`: the last max_length + 1 tokens of
    both, the final continuation token not fed to the model (it is only a target)."""
    if not continuation_ids:
        raise ValueError("a continuation needs at least one token")
    if len(continuation_ids) > max_length:
        raise ValueError(
            f"a continuation of {len(continuation_ids)} tokens does not fit max_length="
            f"{max_length}"
        )
    if not context_ids:
        raise ValueError("a context needs at least one token (the prefix token when empty)")
    whole = [*context_ids, *continuation_ids][-(max_length + 1):]
    return ScoringRow(tuple(whole[:-1]), tuple(whole[1:]), len(continuation_ids))


def rolling_windows(
    token_ids: Sequence[int], prefix_id: int, max_length: int
) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs that score every token of a document once, each with as
    much context as fits max_length: the harness's windows (get_rolling_token_windows,
    context_len=1) made disjoint (make_disjoint_window), as its `hf` model scores them."""
    return [
        harness_utils.make_disjoint_window(window)
        for window in harness_utils.get_rolling_token_windows(
            token_list=list(token_ids), prefix_token=prefix_id, max_seq_len=max_length,
            context_len=1,
        )
    ]


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of `lengths` in batches of at most batch_size, longest rows first (the first
    batch shows at once whether the longest rows fit in memory; similar lengths share a batch)."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def bucket_width(longest: int, max_width: int) -> int:
    """The batch width for rows of up to `longest` tokens: the next power of two (at least
    MIN_WIDTH), at most max_width, so that few shapes compile."""
    width = max(MIN_WIDTH, 1 << max(0, longest - 1).bit_length())
    return max(longest, min(width, max_width))


def pad_rows(
    rows: Sequence[Sequence[int]], width: int, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded tokens [batch_size, width] int32 and lengths [batch_size] int32 of `rows`;
    missing rows repeat the last one (one compiled shape), and are dropped by the caller. The
    filler after a row's length is 0 and is never attended to or scored."""
    tokens = np.zeros((batch_size, width), np.int32)
    lengths = np.zeros((batch_size,), np.int32)
    for index in range(batch_size):
        row = rows[min(index, len(rows) - 1)]
        tokens[index, :len(row)] = row
        lengths[index] = len(row)
    return tokens, lengths


def scored_positions(lengths: jax.Array, num_scored: jax.Array, width: int) -> jax.Array:
    """[batch, width] bool: the last num_scored [batch] of the lengths [batch] valid positions."""
    position = jnp.arange(width)[None, :]
    return (position < lengths[:, None]) & (position >= (lengths - num_scored)[:, None])


def score_from_logits(
    logits: jax.Array,  # [batch, width, vocab]
    targets: jax.Array,  # [batch, width] int
    scored: jax.Array,  # [batch, width] bool
) -> tuple[jax.Array, jax.Array]:
    """Sum of log p(target) over the scored positions [batch] float32, and whether each scored
    target is the argmax there [batch] bool (the continuation is the greedy one)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target_log_probs = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    total = jnp.sum(jnp.where(scored, target_log_probs, 0.0), axis=-1)
    greedy = jnp.all(~scored | (jnp.argmax(logits, axis=-1) == targets), axis=-1)
    return total, greedy


def cut_at_stop(text: str, until: Iterable[str]) -> str:
    """`text` up to the first occurrence of any stop string (empty strings ignored)."""
    cut = len(text)
    for stop in until:
        if stop:
            found = text.find(stop)
            if found != -1:
                cut = min(cut, found)
    return text[:cut]


@functools.partial(jax.jit, static_argnames=("config",))
def score_rows(
    params: Any,
    tokens: jax.Array,  # [batch, width] int32, right-padded
    targets: jax.Array,  # [batch, width] int32
    lengths: jax.Array,  # [batch] int32: valid tokens per row
    num_scored: jax.Array,  # [batch] int32: scored targets, the last of each row's valid ones
    config: ModelConfig,
) -> tuple[jax.Array, jax.Array]:
    """(log-likelihood [batch] float32, is_greedy [batch] bool) of each row's scored targets
    under the decoder-only LM `config` with `params`."""
    width = tokens.shape[1]
    valid = jnp.arange(width)[None, :] < lengths[:, None]
    logits = DecoderLM(config).apply({"params": params}, tokens, valid=valid)
    return score_from_logits(logits, targets, scored_positions(lengths, num_scored, width))


# ------------------------------------------------------------------------- the harness's model


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"add_bos={value!r}: expected true or false")


def load_run(
    workdir: str | Path, step: int | None = None, run_config: Any = None
) -> tuple[ModelConfig, Any, Any, int, jax.sharding.NamedSharding]:
    """(model config, params, tokenizer, training row length, batch sharding) of a training
    run's checkpoint and its mesh, with `run_config` (default: the config the run saved,
    WORKDIR/config.json)."""
    from tfm import saved_config
    from tfm.parallel import sharding
    from tfm.training.experiment import restore_params, setup

    experiment = setup(saved_config.load(workdir) if run_config is None else run_config, workdir)
    if experiment.mode != "lm":
        raise ValueError(
            f"{workdir} is a {experiment.mode} run; the harness's tasks need a decoder-only LM"
        )
    params, _ = restore_params(experiment, step)
    return (experiment.model_config, params, experiment.data.tokenizer,
            experiment.data.train_lengths["inputs"],
            sharding.batch_sharding(experiment.mesh, experiment.rules))


def batch_shards(batch_sharding: jax.sharding.NamedSharding | None) -> int:
    """How many parts a batch sharding splits the batch axis into (1 without one)."""
    if batch_sharding is None:
        return 1
    axes = batch_sharding.spec[0] if batch_sharding.spec else None
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(batch_sharding.mesh.shape[name] for name in names)


def load_folder(directory: str | Path) -> tuple[ModelConfig, Any, Any]:
    """(model config, params, tokenizer) of a Hugging Face folder (tfm.interop.hf)."""
    from tfm.interop import hf

    config, params = hf.load_pretrained(directory)
    if config.num_encoder_layers or not config.num_decoder_layers:
        raise hf.UnsupportedCheckpoint(
            f"{directory} is not a decoder-only LM; the harness's tasks need one"
        )
    tokenizer = hf.load_tokenizer(directory)
    if tokenizer is None:
        raise hf.UnsupportedCheckpoint(f"{directory} has no tokenizer.json")
    return config, params, tokenizer


@register_model("tfm")
class TfmLM(TemplateLM):
    """A tfm decoder-only LM as the harness's model `tfm` (see the module docstring)."""

    def __init__(
        self,
        workdir: str | None = None,
        pretrained: str | None = None,
        step: int | None = None,
        max_length: int | None = None,
        batch_size: int | str | None = None,
        add_bos: bool | str | None = None,
        max_batch_size: int | None = None,  # given by the harness; batches are fixed here
        device: str | None = None,  # given by the harness; JAX places arrays itself
        run_config: Any = None,  # ./launch.sh lm_eval: the run's config with its overrides
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ValueError(
                f"model_args {', '.join(sorted(unknown))} are unknown to tfm; choose from: "
                "workdir, pretrained, step, max_length, batch_size, add_bos"
            )
        if (workdir is None) == (pretrained is None):
            raise ValueError("model_args: give one of workdir=DIR (a tfm training run) or "
                             "pretrained=DIR (a Hugging Face folder)")
        if workdir is not None:
            step = None if step is None else int(step)
            config, params, tokenizer, trained, self.batch_sharding = load_run(
                workdir, step, run_config)
            default_bos = True
        else:
            config, params, tokenizer = load_folder(pretrained)
            trained, default_bos, self.batch_sharding = config.max_len, False, None
        if config.scheme.bounded_by_max_len:
            trained = min(trained, config.max_len)
        self.config, self.params, self.tokenizer = config, params, tokenizer
        self.max_length = int(max_length) if max_length is not None else int(trained)
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = DEFAULT_BATCH_SIZE
        shards = batch_shards(self.batch_sharding)  # batches split over the run's mesh
        self.batch_size = -(-int(batch_size) // shards) * shards
        self.add_bos = default_bos if add_bos is None else _as_bool(add_bos)

    # -- tokens

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids of `string`, after the bos token when add_bos (or add_special_tokens)."""
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        return ([self.prefix_token_id] if bos else []) + list(self.tokenizer.encode(string))

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- loglikelihood

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[
            tuple[float, bool]]:
        """(sum of log p, is_greedy) of each (context ids, continuation ids) pair, in order."""
        rows = [scoring_row(context, continuation, self.max_length)
                for context, continuation in pairs]
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for indices in length_batches([len(row.inputs) for row in rows], self.batch_size):
            batch = [rows[index] for index in indices]
            width = bucket_width(max(len(row.inputs) for row in batch), self.max_length)
            tokens, lengths = pad_rows([row.inputs for row in batch], width, self.batch_size)
            targets, _ = pad_rows([row.targets for row in batch], width, self.batch_size)
            num_scored = np.array([batch[min(i, len(batch) - 1)].num_scored
                                   for i in range(self.batch_size)], np.int32)
            arrays = (tokens, targets, lengths, num_scored)
            if self.batch_sharding is not None:
                arrays = jax.device_put(arrays, self.batch_sharding)
            totals, greedy = jax.device_get(score_rows(self.params, *arrays, self.config))
            for position, index in enumerate(indices):
                results[index] = (float(totals[position]), bool(greedy[position]))
        return results

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        results = self.score([(context, continuation)
                              for _, context, continuation in requests])
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole document (its tokens after the prefix token)."""
        windows, owners = [], []
        for number, request in enumerate(requests):
            (text,) = request.args
            for window in rolling_windows(self.tokenizer.encode(text), self.prefix_token_id,
                                          self.max_length):
                windows.append(window)
                owners.append(number)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self.score(windows), strict=True):
            totals[owner] += log_prob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, with do_sample, sampled) continuations through tfm.decode, cut at the
        first `until` string; at most max_gen_toks tokens each."""
        groups: dict[str, list[int]] = {}
        for number, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str),
                              []).append(number)
        outputs: list[str] = [""] * len(requests)
        for numbers in groups.values():
            gen_kwargs = dict(requests[numbers[0]].args[1])
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(gen_kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            decode = self._decode_config(gen_kwargs, max_gen)
            keep = max(1, self.max_length - max_gen)
            prompts = [self.tok_encode(requests[number].args[0])[-keep:] or
                       [self.prefix_token_id] for number in numbers]
            texts = self.generate_ids(prompts, decode)
            for number, text in zip(numbers, texts, strict=True):
                outputs[number] = cut_at_stop(text, until)
                self.cache_hook.add_partial("generate_until", requests[number].args,
                                            outputs[number])
        return outputs

    def _decode_config(self, gen_kwargs: dict[str, Any], max_gen: int) -> DecodeConfig:
        sample = bool(gen_kwargs.pop("do_sample", False))
        temperature = float(gen_kwargs.pop("temperature", 0.0) or 0.0)
        if sample and temperature > 0:
            return DecodeConfig(method="sample", max_new_tokens=max_gen, temperature=temperature,
                                top_k=int(gen_kwargs.pop("top_k", 0) or 0),
                                top_p=float(gen_kwargs.pop("top_p", 1.0) or 1.0))
        return DecodeConfig(method="greedy", max_new_tokens=max_gen)

    def generate_ids(self, prompts: Sequence[Sequence[int]], decode: DecodeConfig) -> list[str]:
        """The decoded text generated after each prompt (ids), in order."""
        outputs: list[str] = [""] * len(prompts)
        for indices in length_batches([len(p) for p in prompts], self.batch_size):
            batch = [prompts[index] for index in indices]
            width = bucket_width(max(map(len, batch)), max(self.max_length, max(map(len, batch))))
            tokens, lengths = pad_rows(batch, width, self.batch_size)
            output = lm_generate(self.params, self.config, tokens, lengths, decode,
                                 eos_id=self.eot_token_id)
            new_tokens, new_lengths = jax.device_get((output.tokens, output.lengths))
            for position, index in enumerate(indices):
                new = new_tokens[position, :new_lengths[position]].tolist()
                outputs[index] = self.tok_decode(new)
        return outputs


def evaluate(
    model: TfmLM,
    tasks: Sequence[str],
    output_dir: str | Path,
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    include_path: str | None = None,
) -> str:
    """Runs the harness's tasks on `model`; writes OUTPUT_DIR/results.json (the harness's
    results, configs and versions) and returns its table (lm_eval.utils.make_table)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
        task_manager=TaskManager(include_path=include_path),
    )
    if results is None:  # another rank of a distributed harness run
        return ""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    saved = {key: value for key, value in results.items() if key != "samples"}
    (output_dir / "results.json").write_text(
        json.dumps(saved, indent=1, default=str, ensure_ascii=False) + "\n")
    table = harness_utils.make_table(results)
    if "groups" in results:
        table += "\n" + harness_utils.make_table(results, "groups")
    return table


if __name__ == "__main__":  # the harness's command line with `tfm` registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
