"""ModelConfig validation: each bad value raises one readable error naming the field."""

import pytest

from tfm.checks import ConfigError
from tfm.nn.config import ModelConfig, from_dict, paper_base, paper_big


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(d_model=30, num_heads=4), "d_model=30 is not divisible by num_heads=4"),
        (dict(num_heads=8, num_kv_heads=3), "num_heads=8 is not divisible by num_kv_heads=3"),
        (dict(position_scheme="rotary"), "position_scheme='rotary' is unknown; choose one of: "
         "none, sinusoidal, learned, rope, relative, t5_bias, alibi"),
        (dict(activation="tanh"), "activation='tanh' is unknown; choose one of: relu, gelu"),
        (dict(norm_type="batchnorm"), "norm_type='batchnorm' is unknown"),
        (dict(attention_backend="flash"), "attention_backend='flash' is unknown"),
        (dict(dropout_rate=1.0), "dropout_rate=1.0 must be a number in"),
        (dict(position_scheme="rope", head_dim=6, rope_fraction=0.5), "rotates 3 of head_dim=6"),
        (dict(share_embeddings=True, source_vocab_size=300), "share_embeddings=True needs"),
        (dict(attention_backend="xla", attention_dropout_rate=0.1),
         "attention_backend='xla' cannot serve this model: attention_dropout_rate > 0"),
        (dict(attention_backend="xla", position_scheme="relative"),
         "relative_values=True needs the attention weights"),
        (dict(activation="gelu_new"), "activation='gelu_new' is unknown; choose one of: relu, "
         "gelu, gelu_tanh, swiglu, geglu"),
        (dict(final_norm="yes"), "final_norm='yes' must be one of: True, False or None"),
        (dict(qkv_bias=1), "qkv_bias=1 must be one of: True, False or None"),
        (dict(attention_out_bias="no"), "attention_out_bias='no' must be one of"),
        (dict(mlp_bias=0.0), "mlp_bias=0.0 must be one of"),
        (dict(lm_head_bias="x"), "lm_head_bias='x' must be one of"),
        (dict(attention_scale=0.0), "attention_scale=0.0 must be None (the default) or a number"),
        (dict(output_scale=-1), "output_scale=-1 must be None (the default) or a number > 0"),
        (dict(pad_id=-1), "pad_id=-1 must be an integer >= 0"),
        (dict(type_vocab_size=-2), "type_vocab_size=-2 must be an integer >= 0"),
        (dict(embedding_norm=None), "embedding_norm=None must be one of: True or False"),
        (dict(rope_scaling="yaarn"), "rope_scaling='yaarn' is unknown; choose one of: none, "
         "linear, ntk, dynamic, yarn, longrope, llama3"),
        (dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_beta_fast=1.0),
         "rope_beta_fast=1.0 must be > rope_beta_slow=1.0 > 0 for rope_scaling='yarn'"),
        (dict(rope_scaling="longrope", rope_short_factor=[1.0]),
         "rope_short_factor must hold 32 positive numbers"),
        (dict(rope_scaling_factor=0), "rope_scaling_factor=0 must be a number > 0"),
        (dict(rope_original_max_len=0), "rope_original_max_len=0 must be an integer > 0"),
        (dict(rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0),
         "rope_high_freq_factor=1.0 must be > rope_low_freq_factor=4.0"),
    ],
)
def test_bad_values_name_the_field(changes, message):
    with pytest.raises(ConfigError) as error:
        ModelConfig(**changes)
    assert message in str(error.value)


def test_unknown_field_is_rejected_with_the_known_ones():
    with pytest.raises(ConfigError, match="model.position_schem is unknown; known model fields"):
        from_dict({"position_schem": "rope"})


def test_head_dim_may_be_set_when_d_model_does_not_divide():
    config = ModelConfig(d_model=30, num_heads=4, head_dim=8)
    assert config.resolved_head_dim == 8


def test_presets_match_the_paper_and_replace_revalidates():
    base = paper_base()
    assert (base.d_model, base.d_ff, base.num_heads, base.dropout_rate) == (512, 2048, 8, 0.1)
    assert (base.num_encoder_layers, base.num_decoder_layers, base.share_embeddings) == (6, 6, True)
    big = paper_big()
    assert (big.d_model, big.d_ff, big.num_heads, big.dropout_rate) == (1024, 4096, 16, 0.3)
    with pytest.raises(ConfigError, match="num_heads"):
        base.replace(num_heads=7)


def test_derived_knobs_resolve_their_defaults():
    base = ModelConfig(d_model=64, num_heads=4)
    assert base.resolved_attention_scale == 16**-0.5
    assert base.replace(attention_scale=1.0).resolved_attention_scale == 1.0
    assert not base.has_final_norm and base.replace(norm_placement="pre").has_final_norm
    assert base.replace(final_norm=True).has_final_norm
    assert not base.replace(norm_placement="pre", final_norm=False).has_final_norm
    qwen = base.replace(use_bias=False, qkv_bias=True)
    assert [qwen.has_bias(g) for g in ("qkv", "attention_out", "mlp", "lm_head")] == [
        True, False, False, False
    ]
    assert base.has_bias("mlp") and not base.has_bias("lm_head")
    assert ModelConfig(pad_id=None).pad_id is None
    with pytest.raises(ConfigError, match="bias group='ffn' is unknown; choose one of: qkv"):
        base.has_bias("ffn")


def test_decode_config_is_hashable_and_checked_once():
    from tfm.decode.search import DecodeConfig

    decode = DecodeConfig("beam", 8, beam_size=2)
    assert {decode: 1}[DecodeConfig("beam", 8, beam_size=2)] == 1
    for changes, message in [
        (dict(beam_size=0), "beam_size=0 must be an integer >= 1"),
        (dict(method="nucleus"), "method='nucleus' is unknown; choose one of: greedy, sample"),
        (dict(top_p=0.0), "top_p=0.0 must be a number in"),
        (dict(temperature=True), "temperature=True must be a number > 0"),
        (dict(max_new_tokens=0), "max_new_tokens=0 must be an integer >= 1"),
        (dict(cache_segments=0), "cache_segments=0 must be an integer >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            DecodeConfig(**changes)


def test_experiment_sections_name_their_field():
    from tfm.training.experiment import EvalConfig, GenerateConfig, TrainConfig

    with pytest.raises(ConfigError, match=r"generate.beam_size=0 must be an integer >= 1"):
        GenerateConfig.from_section({"beam_size": 0})
    with pytest.raises(ConfigError, match=r"eval.alpha=nan must be a finite number"):
        EvalConfig(alpha=float("nan"))
    with pytest.raises(ConfigError, match=r"eval.cache_segments=1.5 must be an integer >= 1"):
        EvalConfig(cache_segments=1.5)
    with pytest.raises(ConfigError, match=r"generate.cache_segments=0 must be an integer"):
        GenerateConfig.from_section({"cache_segments": 0})
    assert GenerateConfig.from_section({"cache_segments": 3}).decode.cache_segments == 3
    with pytest.raises(ConfigError, match=r"train.max_to_keep=0 must be an integer >= 1"):
        TrainConfig(max_to_keep=0)
    beam = GenerateConfig.from_section({"method": "beam"})
    assert beam.decode_config("seq2seq").max_new_tokens is None
    assert beam.decode_config("lm").max_new_tokens == 64
