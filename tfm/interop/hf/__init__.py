"""Load and save Hugging Face checkpoints: GPT-2, Llama (and Mistral, Qwen2), T5 (v1.0, v1.1),
BERT (the encoder); and `torch.nn.Transformer` state dicts.

`load_pretrained(directory) -> (ModelConfig, params)` reads a local Hugging Face model folder
(`config.json` plus `model.safetensors`, sharded safetensors, or `pytorch_model.bin`) with
safetensors' numpy API: no torch is needed (except for `.bin` files). `params` are plain numpy
arrays in the unrolled layout of `model_for(config)` (`tfm.nn.models.stack_layer_params` converts
them for `scan_layers=True`). `save_pretrained(config, params, directory)` writes GPT-2 and
Llama-family configs back, so a tfm-trained model opens in Hugging Face tools.

Each architecture is one module of this package and one `Architecture` entry of
`ARCHITECTURES` (what it reads by config.json `model_type`, and how it writes); a new one is a
module and an entry. Anything the mapping cannot express fails with one line naming the field,
its value and what is supported, before any weight is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from tfm.data.tokenizers import HFTokenizer
from tfm.interop.hf import bert, gpt2, llama, t5
from tfm.interop.hf.common import (
    Architecture,
    Params,
    UnreadableCheckpoint,
    UnsupportedCheckpoint,
    read_config,
    read_tensors,
    unstack,
    unsupported,
    write_folder,
)
from tfm.interop.hf.torch_transformer import load_torch_transformer
from tfm.nn.config import ModelConfig
from tfm.nn.families import family_of

__all__ = [
    "ARCHITECTURES", "FAMILIES", "SAVE_FAMILIES", "Architecture", "UnreadableCheckpoint",
    "UnsupportedCheckpoint", "config_from_hf", "generate_pretrained", "load_pretrained",
    "load_tokenizer", "load_torch_transformer", "model_for", "read_config", "read_tensors",
    "save_pretrained",
]

ARCHITECTURES: dict[str, Architecture] = {
    module.ARCHITECTURE.name: module.ARCHITECTURE for module in (gpt2, llama, t5, bert)
}
_BY_MODEL_TYPE = {
    model_type: architecture
    for architecture in ARCHITECTURES.values() for model_type in architecture.model_types
}
FAMILIES = tuple(_BY_MODEL_TYPE)  # the config.json model_type values tfm reads
SAVE_FAMILIES = tuple(  # the model_type values save_pretrained writes
    model_type for architecture in ARCHITECTURES.values() for model_type in architecture.save_types
)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The tfm ModelConfig of a Hugging Face config.json; unsupported fields raise one line."""
    model_type = hf.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise unsupported("model_type", model_type, ", ".join(FAMILIES))
    return _BY_MODEL_TYPE[model_type].config(hf)


def load_pretrained(directory: str | Path) -> tuple[ModelConfig, Params]:
    """(ModelConfig, params) of a local Hugging Face model folder; see the module docstring."""
    hf = read_config(directory)
    config = config_from_hf(hf)
    params = _BY_MODEL_TYPE[hf["model_type"]].params(config, hf, read_tensors(directory))
    return config, params


def model_for(config: ModelConfig) -> Any:
    """The tfm module a loaded config describes: DecoderLM, EncoderDecoder or Encoder."""
    return family_of(config).model(config)


def load_tokenizer(directory: str | Path) -> HFTokenizer | None:
    """The folder's `tokenizer.json` as the data pipeline's HFTokenizer (the same ids and special
    tokens as data.tokenizer="hf:DIR"), or None when the folder has none."""
    if not (Path(directory) / "tokenizer.json").is_file():
        return None
    try:
        return HFTokenizer.load(directory)
    except ValueError as error:
        raise UnsupportedCheckpoint(str(error)) from None


def _architecture_for_save(config: ModelConfig) -> Architecture:
    """The first writable architecture whose save_fields `config` has; else one line of what
    differs from each."""
    writable = [entry for entry in ARCHITECTURES.values() if entry.save_fields is not None]
    for architecture in writable:
        if not architecture.differences(config):
            return architecture
    differences = " and ".join(
        f"from {entry.name} in {', '.join(entry.differences(config))}" for entry in writable
    )
    raise UnsupportedCheckpoint(
        f"save_pretrained writes {' or '.join(entry.name for entry in writable)} configs only; "
        f"this config differs {differences}"
    )


def save_pretrained(config: ModelConfig, params: Params, directory: str | Path) -> str:
    """Writes config.json and model.safetensors of a GPT-2 or Llama-family tfm model into
    `directory`; returns the Hugging Face model_type."""
    architecture = _architecture_for_save(config)
    model_type = architecture.save_type(config)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    params = unstack(params, config.num_decoder_layers)
    write_folder(directory, architecture.save_config(config, model_type),
                 architecture.save_tensors(config, params))
    return model_type


def _prompt_ids(prompts: list[str], tokenizer: HFTokenizer | None) -> list[list[int]]:
    """Token ids of each prompt: encoded by `tokenizer`, or space-separated ids (None)."""
    if tokenizer is None:
        try:
            encoded = [[int(t) for t in prompt.split()] for prompt in prompts]
        except ValueError as error:
            message = f"--prompt_ids needs space-separated ids: {error}"
            raise UnsupportedCheckpoint(message) from None
    else:
        encoded = [tokenizer.encode(prompt) for prompt in prompts]
    if any(not ids for ids in encoded):
        raise UnsupportedCheckpoint("every prompt needs at least one token")
    return encoded


def generate_pretrained(
    directory: str | Path,
    prompts: list[str],
    *,
    max_new_tokens: int = 32,
    prompt_ids: bool = False,
) -> list[str]:
    """Greedy continuations (decoder-only) or outputs (T5) of text prompts, through the
    folder's tokenizer.json; with `prompt_ids` the prompts are space-separated token ids and
    the outputs are ids too. Rows are right-padded with zeros and carry their lengths, so each
    prompt continues from its own end."""
    from tfm.decode.generate import lm_generate, pad_batch, translate

    config, params = load_pretrained(directory)
    hf_config = read_config(directory)
    tokenizer = None if prompt_ids else load_tokenizer(directory)
    if not prompt_ids and tokenizer is None:
        raise UnsupportedCheckpoint(f"{directory} has no tokenizer.json; pass token ids with "
                                    "--prompt_ids")
    tokens, lengths = pad_batch(_prompt_ids(prompts, tokenizer), pad_id=0)
    family = family_of(config)
    if family.generator is None:
        raise UnsupportedCheckpoint(
            f"{directory} holds an encoder ({hf_config.get('model_type')}): nothing to generate"
        )
    eos = hf_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    eos = config.vocab_size - 1 if eos is None else eos  # a model without EOS runs to the end
    if family.reads_source:
        start = hf_config.get("decoder_start_token_id")
        output = translate(
            params, config, tokens, lengths, method="greedy", eos_id=eos,
            bos_id=config.pad_id if start is None else start, max_new_tokens=max_new_tokens,
        )
    else:
        output = lm_generate(params, config, tokens, lengths, max_new_tokens=max_new_tokens,
                             eos_id=eos)
    texts = []
    for row, length in zip(np.asarray(output.tokens), np.asarray(output.lengths), strict=True):
        new = row[:length].tolist()
        texts.append(" ".join(map(str, new)) if tokenizer is None else tokenizer.decode(new))
    return texts
