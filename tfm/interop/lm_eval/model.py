"""The harness's model `tfm` (TfmLM) and `evaluate`, which runs tasks on it from one process or
several (see the package's docstring)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

# The harness's own models (registered lazily; no torch): its get_model imports them only while
# its registry is empty, so registering tfm first would hide them.
import lm_eval.models  # noqa: F401
import numpy as np
from jax.experimental import multihost_utils
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from tfm.decode.generate import lm_generate
from tfm.decode.search import DecodeConfig
from tfm.interop.lm_eval import hosts
from tfm.interop.lm_eval.rows import (
    bucket_width,
    cut_at_stop,
    length_batches,
    pad_rows,
    rolling_windows,
    score_rows,
    scoring_row,
)
from tfm.nn.config import ModelConfig

DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for generate_until


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
    if experiment.family.reads_source:  # an encoder-decoder: the harness scores one text
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
        # A run's params live on its whole mesh: with several processes every one runs each
        # batch (process 0 shares it). A Hugging Face folder is loaded whole by each process,
        # and process 0 runs it alone.
        self.shared = self.batch_sharding is not None and jax.process_count() > 1

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
            outputs = self.run_step(hosts.Message("score", arrays={
                "tokens": tokens, "targets": targets, "lengths": lengths,
                "num_scored": num_scored}))
            for position, index in enumerate(indices):
                results[index] = (float(outputs["totals"][position]),
                                  bool(outputs["greedy"][position]))
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
            generated = self.run_step(hosts.Message(
                "generate", meta={"decode": dataclasses.asdict(decode)},
                arrays={"tokens": tokens, "lengths": lengths}))
            for position, index in enumerate(indices):
                new = generated["tokens"][position, :generated["lengths"][position]].tolist()
                outputs[index] = self.tok_decode(new)
        return outputs

    # -- one step, on one process or on all of them

    def run_step(self, message: hosts.Message) -> dict[str, np.ndarray]:
        """Runs one batch (`message`), first sharing it with the other processes when several
        hold the run's mesh; its outputs (numpy) on every process."""
        if self.shared:
            message = hosts.share(message)
        return self._execute(message)

    def _execute(self, message: hosts.Message) -> dict[str, np.ndarray]:
        arrays = message.arrays
        if message.op == "score":
            if self.batch_sharding is not None:  # rows split over the data-parallel devices
                arrays = {name: jax.make_array_from_callback(
                    array.shape, self.batch_sharding, lambda index, array=array: array[index])
                    for name, array in arrays.items()}
            totals, greedy = score_rows(
                self.params, arrays["tokens"], arrays["targets"], arrays["lengths"],
                arrays["num_scored"], self.config)
            return {"totals": _fetch(totals), "greedy": _fetch(greedy)}
        if message.op == "generate":
            output = lm_generate(self.params, self.config, arrays["tokens"], arrays["lengths"],
                                 DecodeConfig(**message.meta["decode"]),
                                 eos_id=self.eot_token_id)
            return {"tokens": _fetch(output.tokens), "lengths": _fetch(output.lengths)}
        raise ValueError(f"op={message.op!r} is unknown; choose one of: score, generate")

    def follow(self) -> None:
        """A process other than 0: runs each batch process 0 shares, until it says stop."""
        while (message := hosts.share(None)).op != hosts.STOP:
            self._execute(message)

    def release_followers(self) -> None:
        """Process 0, once done: ends the other processes' `follow` loops."""
        if self.shared and hosts.is_leader():
            hosts.share(hosts.Message(hosts.STOP))


def _fetch(array: jax.Array) -> np.ndarray:
    """The whole of `array` as numpy, also when its shards live on several processes."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


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
    results, configs and versions) and returns its table (lm_eval.utils.make_table). Every
    process calls it: process 0 runs the harness, the others run the batches it shares with
    them and return "" (as does process 0 of a run without results)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    if model.shared and not hosts.is_leader():
        model.follow()  # process 0 runs the harness and shares its batches
        return ""
    try:
        results = lm_eval.simple_evaluate(
            model=model, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
            task_manager=TaskManager(include_path=include_path),
        )
    finally:  # also when the harness fails: the other processes must not wait forever
        model.release_followers()
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


