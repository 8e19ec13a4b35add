"""Hugging Face checkpoints: tiny random-initialised models saved by
tests/fixtures/make_hf_fixtures.py load into tfm and reproduce the reference logits (within
1e-4 in float32) and greedy tokens exactly; export -> load round trips; unsupported
architectures and fields fail with one line. No torch needed except in the live test."""

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tfm.decode.generate import lm_generate, translate
from tfm.interop import hf
from tfm.nn.models import stack_layer_params
from tfm.training.experiment import init_state, setup, state_shardings

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"
DECODERS = ("gpt2", "llama", "llama3_rope", "linear_rope", "yarn_rope", "dynamic_rope",
            "longrope_rope", "qwen2", "qwen2_window", "mistral")
SCALED = ("llama3_rope", "linear_rope", "yarn_rope", "dynamic_rope", "longrope_rope")
TOLERANCE = 1e-4


def load(family: str):
    config, params = hf.load_pretrained(FIXTURES / family)
    return config, params, dict(np.load(FIXTURES / family / "reference.npz"))


def forward(family: str, config, params, reference: dict) -> np.ndarray:
    model = hf.model_for(config)
    ids = jnp.asarray(reference["input_ids"])
    if family == "bert":
        return np.asarray(model.apply(
            {"params": params}, ids, valid=reference["attention_mask"].astype(bool),
            token_types=jnp.asarray(reference["token_type_ids"]),
        ))
    if family.startswith("t5"):
        return np.asarray(model.apply(
            {"params": params}, ids, jnp.asarray(reference["decoder_input_ids"])
        ))
    return np.asarray(model.apply({"params": params}, ids))


@pytest.mark.parametrize("family", [*DECODERS, "t5", "t5_v1_1"])
def test_logits_match_the_reference(family):
    config, params, reference = load(family)
    logits = forward(family, config, params, reference)
    assert logits.shape == reference["logits"].shape
    assert np.abs(logits - reference["logits"]).max() < TOLERANCE
    assert np.abs(reference["logits"]).max() > 1e-2  # the reference is not trivially zero


@pytest.mark.parametrize("family", SCALED)
def test_rope_scaling_is_what_makes_the_scaled_fixtures_match(family):
    config, params, reference = load(family)
    assert config.rope_scaling != "none"
    unscaled = forward(family, config.replace(rope_scaling="none"), params, reference)
    assert np.abs(unscaled - reference["logits"]).max() > 1e-3


def test_bert_hidden_states_match_the_reference_with_padding_and_token_types():
    config, params, reference = load("bert")
    hidden = forward("bert", config, params, reference)
    real = reference["attention_mask"].astype(bool)
    assert np.abs(hidden - reference["hidden"])[real].max() < TOLERANCE


def _check_greedy(tokens, lengths, want, eos_id):
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    for row, length in enumerate(lengths):
        np.testing.assert_array_equal(tokens[row, :length], want[row, :length])
        assert length == want.shape[1] or tokens[row, length - 1] == eos_id


@pytest.mark.parametrize("family", DECODERS)
def test_cached_greedy_decoding_matches_the_reference_tokens(family):
    config, params, reference = load(family)
    eos_id = json.loads((FIXTURES / family / "config.json").read_text())["eos_token_id"]
    prompts = reference["input_ids"]
    steps = reference["greedy"].shape[1]
    output = lm_generate(params, config, prompts, np.full(len(prompts), prompts.shape[1]),
                         max_new_tokens=steps, eos_id=eos_id)
    _check_greedy(output.tokens, output.lengths, reference["greedy"], eos_id)


@pytest.mark.parametrize("family", ["t5", "t5_v1_1"])
def test_t5_greedy_translation_matches_the_reference_tokens(family):
    """T5's decoder starts with token 0, which is also its pad: it must not be masked."""
    config, params, reference = load(family)
    steps = reference["greedy"].shape[1]
    output = translate(params, config, reference["input_ids"], method="greedy", bos_id=0,
                       eos_id=1, max_new_tokens=steps)
    _check_greedy(output.tokens, output.lengths, reference["greedy"], 1)


def test_scanned_layers_load_the_same_checkpoint():
    config, params, reference = load("llama")
    scanned = config.replace(scan_layers=True)
    logits = forward("llama", scanned, stack_layer_params(params), reference)
    assert np.abs(logits - reference["logits"]).max() < TOLERANCE


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", *SCALED])
def test_save_then_load_round_trips_config_params_and_logits(family, tmp_path):
    config, params, reference = load(family)
    saved_type = family if family in ("gpt2", "qwen2") else "llama"
    assert hf.save_pretrained(config, params, tmp_path) == saved_type
    again, params_again = hf.load_pretrained(tmp_path)
    assert again == config
    flat = lambda p: {k: v for k, v in _flatten(p)}
    assert flat(params_again).keys() == flat(params).keys()
    for key, value in flat(params).items():
        np.testing.assert_array_equal(flat(params_again)[key], value, err_msg=key)
    logits = forward(family, again, params_again, reference)
    assert np.abs(logits - reference["logits"]).max() < TOLERANCE


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", np.asarray(value)


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("gpt2", dict(model_type="gptj"), "model_type='gptj' is not supported; supported: gpt2"),
        ("gpt2", dict(activation_function="swish"), "activation_function='swish' is not"),
        ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
        ("llama", dict(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}),
         "rope_scaling.rope_type='proportional' is not supported"),
        ("qwen2_window", dict(max_window_layers=1), "max_window_layers=1 is not supported"),
        ("llama", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported; supported: 'silu'"),
        ("t5", dict(feed_forward_proj="gated-silu"), "feed_forward_proj='gated-silu' is not"),
        ("bert", dict(position_embedding_type="relative_key"), "position_embedding_type="),
    ],
)
def test_unsupported_fields_fail_with_one_line_naming_them(family, change, message, tmp_path):
    folder = tmp_path / family
    shutil.copytree(FIXTURES / family, folder)
    values = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**values, **change}))
    with pytest.raises(hf.UnsupportedCheckpoint) as error:
        hf.load_pretrained(folder)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_save_rejects_configs_it_cannot_express(tmp_path):
    config, params, _ = load("t5")
    with pytest.raises(hf.UnsupportedCheckpoint, match="writes GPT-2 or Llama configs only"):
        hf.save_pretrained(config, params, tmp_path)
    config, params, _ = load("llama")
    with pytest.raises(hf.UnsupportedCheckpoint, match="biases on the attention output but"):
        hf.save_pretrained(config.replace(attention_out_bias=True), params, tmp_path)


def test_a_tfm_trained_llama_config_saves_with_default_bias_fields(tmp_path):
    """qkv_bias=None etc. (the ModelConfig defaults) resolve through use_bias."""
    config, params, reference = load("llama")
    plain = config.replace(qkv_bias=None, attention_out_bias=None, mlp_bias=None)
    assert hf.save_pretrained(plain, params, tmp_path) == "llama"
    again, params_again = hf.load_pretrained(tmp_path)
    logits = forward("llama", again, params_again, reference)
    assert np.abs(logits - reference["logits"]).max() < TOLERANCE


def test_missing_weights_are_named(tmp_path):
    shutil.copy(FIXTURES / "gpt2" / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="expected model.safetensors"):
        hf.load_pretrained(tmp_path)


def _truncated_folder(tmp_path, family: str = "gpt2") -> Path:
    """A folder written by save_pretrained whose model.safetensors lost its second half."""
    config, params, _ = load(family)
    folder = tmp_path / "truncated"
    hf.save_pretrained(config, params, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


def test_truncated_weights_are_one_line_naming_the_file(tmp_path):
    folder = _truncated_folder(tmp_path)
    with pytest.raises(hf.UnreadableCheckpoint) as error:
        hf.load_pretrained(folder)
    assert str(error.value).startswith(
        f"model.safetensors in {folder} is unreadable (truncated or not a safetensors file): ")
    assert "\n" not in str(error.value)


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="needs transformers and torch",
)
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", *SCALED])
def test_live_regenerate_compare_and_open_the_export_in_transformers(family, tmp_path,
                                                                   monkeypatch):
    import torch
    import transformers

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "fixtures"))  # undone afterwards
    import make_hf_fixtures

    reference = make_hf_fixtures.make(family, tmp_path / "hf", seed=1)
    config, params = hf.load_pretrained(tmp_path / "hf")
    logits = forward(family, config, params, reference)
    assert np.abs(logits - reference["logits"]).max() < TOLERANCE
    hf.save_pretrained(config, params, tmp_path / "export")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        exported = model(input_ids=torch.tensor(reference["input_ids"])).logits.numpy()
    assert np.abs(exported - logits).max() < TOLERANCE


# ------------------------------------------------------------------- torch.nn.Transformer


def test_torch_transformer_post_ln_with_final_norms_matches_logits_and_greedy():
    folder = FIXTURES / "torch_transformer"
    config, params = hf.load_torch_transformer(folder / "model.safetensors", num_heads=4)
    assert (config.norm_placement, config.final_norm) == ("post", True)
    reference = dict(np.load(folder / "reference.npz"))
    model = hf.model_for(config)
    source, source_valid = reference["input_ids"], reference["source_valid"]
    logits = np.asarray(model.apply({"params": params}, jnp.asarray(source),
                                    jnp.asarray(reference["decoder_input_ids"]),
                                    source_valid=jnp.asarray(source_valid)))
    assert np.abs(logits - reference["logits"]).max() < TOLERANCE
    steps = reference["greedy"].shape[1]
    output = translate(params, config, source, source_valid.sum(1), method="greedy", bos_id=1,
                       eos_id=config.vocab_size - 1, max_new_tokens=steps)
    _check_greedy(output.tokens, output.lengths, reference["greedy"], config.vocab_size - 1)
    # The final norms are what makes it match.
    without = {**params}
    for side in ("encoder", "decoder"):
        stack = {k: v for k, v in params[side]["stack"].items() if k != "final_norm"}
        without[side] = {"stack": stack}
    plain = hf.model_for(config.replace(final_norm=None)).apply(
        {"params": without}, jnp.asarray(source), jnp.asarray(reference["decoder_input_ids"]),
        source_valid=jnp.asarray(source_valid))
    assert np.abs(np.asarray(plain) - reference["logits"]).max() > 1e-3


# ------------------------------------------------------------------------ the command line


def launch(*args: str) -> subprocess.CompletedProcess:
    repo = Path(__file__).resolve().parents[2]
    return subprocess.run(["bash", str(repo / "launch.sh"), *args], cwd=repo,
                          capture_output=True, text=True, timeout=300)


def test_launch_generate_pretrained_continues_text_and_ids_like_the_reference():
    reference = load("gpt2")[2]
    prompt = reference["input_ids"][0].tolist()
    want = reference["greedy"][0].tolist()
    result = launch(
        "generate", "--pretrained", str(FIXTURES / "gpt2"), "--max_new_tokens", "6",
        "--prompt", " ".join(f"w{i}" for i in prompt),  # tokenizer.json: word-level w0..w63
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().split("\t->\t")[1] == " ".join(f"w{i}" for i in want)


def test_launch_generate_pretrained_errors_are_one_line(tmp_path):
    result = launch("generate", "--pretrained", str(FIXTURES / "bert"), "--prompt", "1 2",
                    "--prompt_ids")
    assert result.returncode == 1
    assert result.stderr.strip().endswith("holds an encoder (bert): nothing to generate")
    result = launch("generate", "--pretrained", str(tmp_path / "missing"), "--prompt", "x")
    assert result.returncode == 2
    assert result.stderr == f"launch.sh: --pretrained folder '{tmp_path / 'missing'}' not found\n"
    result = launch("generate", f"--pretrained={tmp_path / 'missing'}", "--prompt", "x")
    assert result.returncode == 2 and f"'{tmp_path / 'missing'}' not found" in result.stderr
    result = launch("generate", "--pretrained", str(_truncated_folder(tmp_path)), "--prompt", "x")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        f"tfm.main generate: UnreadableCheckpoint: model.safetensors in {tmp_path / 'truncated'} "
        "is unreadable (truncated or not a safetensors file): "), line


# ------------------------------------------------------------ fine-tuning from a folder


def _finetune_config(tmp_path, folder, **model):
    from configs import synthetic_lm

    config = synthetic_lm.get_config("runlocal")
    config.data.update(data_dir=str(tmp_path / "data"), num_train_examples=64,
                       num_eval_examples=16)
    config.model.update(**model)
    config.init.pretrained = str(folder)
    return config


@pytest.mark.parametrize("scan, mesh", [(False, None), (True, dict(data=2, fsdp=2, tensor=2))])
def test_training_starts_from_the_pretrained_parameters(tmp_path, scan, mesh):
    """Unrolled on one device, and scanned on a 2x2x2 mesh (8 simulated devices)."""
    import jax


    config = _finetune_config(tmp_path, FIXTURES / "llama", scan_layers=scan)
    if mesh is not None:
        config.mesh.update(mesh)
    devices = jax.devices()[:1] if mesh is None else None
    experiment = setup(config, tmp_path / "run", devices=devices)
    pretrained_config, params = hf.load_pretrained(FIXTURES / "llama")
    # setup resolves attention_backend="auto" for the mesh's platform
    assert experiment.model_config == pretrained_config.replace(scan_layers=scan).for_platform(
        experiment.platform)
    _, shardings = state_shardings(experiment)
    state = init_state(experiment, shardings)
    if mesh is not None:  # really spread over the mesh
        kernel = state.params["decoder"]["stack"]["layers"]["feed_forward"]["wi"]["kernel"]
        assert len(kernel.sharding.device_set) == 8
    want = stack_layer_params(params) if scan else params
    got = dict(_flatten(jax.device_get(state.params)))
    for key, value in _flatten(want):
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_finetuning_from_truncated_weights_is_one_line(tmp_path):
    folder = _truncated_folder(tmp_path, "llama")
    result = launch("train", "configs/synthetic_lm.py:runlocal",
                    f"--config.init.pretrained={folder}", f"--config.data.data_dir={tmp_path}",
                    "--workdir", str(tmp_path / "run"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"tfm.main train: UnreadableCheckpoint: model.safetensors in {folder} is unreadable")


def test_pretrained_folder_errors_name_the_field(tmp_path):
    from tfm.checks import ConfigError

    with pytest.raises(ConfigError, match="init.pretrained='/nowhere' must be a Hugging Face"):
        setup(_finetune_config(tmp_path, "/nowhere"), tmp_path / "run")
    with pytest.raises(ConfigError, match="holds a seq2seq model but the data is for a lm task"):
        setup(_finetune_config(tmp_path, FIXTURES / "t5"), tmp_path / "run")
