"""tfm/nn/families.py: every entry names things that exist in the registries it points at, and
the data, generation and evaluation choices follow the entry."""

import pytest

from tfm.checks import ConfigError
from tfm.data import pipeline
from tfm.decode import generate
from tfm.nn.config import ModelConfig
from tfm.nn.families import FAMILIES, MODES, family_for_data, family_of, get_family
from tfm.training.config import GENERATION_METRICS


@pytest.mark.parametrize("name", list(FAMILIES))
def test_entries_point_at_what_exists(name):
    family = FAMILIES[name]
    for record_format in (family.text_format, family.pair_format):
        assert record_format is None or record_format in pipeline.FORMATS
    assert family.generator is None or family.generator in generate.GENERATORS
    assert family.pair_metric in GENERATION_METRICS
    assert (name in MODES) == (family.pair_format is not None)


def test_families_read_a_source_exactly_when_they_have_an_encoder():
    assert [f.name for f in FAMILIES.values() if f.reads_source] == ["seq2seq", "encoder"]
    assert generate.GENERATORS[get_family("seq2seq").generator][0] is generate.translate
    assert generate.GENERATORS[get_family("lm").generator][0] is generate.lm_generate


def test_the_family_of_a_dataset_and_of_a_checkpoint():
    assert family_for_data(True, None).name == "lm"
    assert family_for_data(False, None).name == "seq2seq"
    assert family_for_data(False, "lm").pair_format == "prompt_answer"
    with pytest.raises(ConfigError, match="data.mode='seq2seq' needs pairs"):
        family_for_data(True, "seq2seq")
    with pytest.raises(ConfigError, match="'gpt' is unknown; choose one of: lm, seq2seq, encoder$"):
        get_family("gpt")
    layers = dict(num_encoder_layers=2, num_decoder_layers=3)
    assert family_of(ModelConfig(**layers)).name == "seq2seq"
    assert family_of(ModelConfig(**{**layers, "num_encoder_layers": 0})).name == "lm"
    assert family_of(ModelConfig(**{**layers, "num_decoder_layers": 0})).name == "encoder"


def test_special_ids_follow_the_family():
    class Ids:
        bos_id, eos_id = 7, 8

    assert generate.special_ids(Ids, "lm") == {"eos_id": 8}
    assert generate.special_ids(Ids, "seq2seq") == {"eos_id": 8, "bos_id": 7}
