"""ModelConfig validation: each bad value raises one readable error naming the field."""

import pytest

from tfm.config import ConfigError, ModelConfig, from_dict, paper_base, paper_big


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
        (dict(attention_backend="xla", attention_dropout_rate=0.1), "needs attention_backend="),
        (dict(attention_backend="xla", position_scheme="relative"), "relative_values=True needs"),
    ],
)
def test_bad_values_name_the_field(changes, message):
    with pytest.raises(ConfigError) as error:
        ModelConfig(**changes)
    assert message in str(error.value)


def test_unknown_field_is_rejected_with_the_known_ones():
    with pytest.raises(ConfigError, match="unknown field.*position_schem\\b.*known fields"):
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
