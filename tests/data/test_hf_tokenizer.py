"""data.tokenizer="hf:DIR": a Hugging Face tokenizer.json with the model's own ids, for text LM
and translation data, fine-tuning from the same folder, and generate --pretrained."""

import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tfm.checks import ConfigError
from tfm.data import build_data
from tfm.data.build import DataConfig
from tfm.data.tokenizers import HFTokenizer, unknown_characters
from tfm.interop import hf

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"
TEXT = "The cat sat on the mat.\nA dog ran; the cat hid.\nÜber café, naïve façade!\n"
SPECIAL = ["<pad>", "<s>", "</s>"]


def write_bpe(folder: Path, texts: list[str], *, config: bool = True) -> Tokenizer:
    """A tiny byte-level BPE trained on `texts`, its special tokens added last (ids 3+ past the
    merges), so they differ from tfm's own 0, 1, 2; `config` names them in
    tokenizer_config.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens(SPECIAL)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if config:
        names = dict(pad_token="<pad>", bos_token={"content": "<s>"}, eos_token="</s>")
        (folder / "tokenizer_config.json").write_text(json.dumps(names))
    return tokenizer


@pytest.fixture
def bpe_folder(tmp_path) -> Path:
    write_bpe(tmp_path / "bpe", TEXT.splitlines())
    return tmp_path / "bpe"


def test_round_trip_vocab_size_and_special_ids(bpe_folder):
    tokenizer = HFTokenizer.load(bpe_folder)
    raw = Tokenizer.from_file(str(bpe_folder / "tokenizer.json"))
    assert tokenizer.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    pad, bos, eos = (raw.token_to_id(token) for token in SPECIAL)
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (pad, bos, eos)
    assert eos == tokenizer.vocab_size - 1 and pad > 2  # not tfm's 0, 1, 2
    ids = tokenizer.encode(TEXT)
    assert ids == raw.encode(TEXT, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode([bos, *ids, eos, *ids, pad]) == TEXT  # stops at eos
    assert unknown_characters(tokenizer, "ß€") == []  # bytes: no unk
    again = pickle.loads(pickle.dumps(tokenizer))  # grain workers get a copy
    assert again == tokenizer and again.decode(ids) == TEXT


def test_special_ids_without_tokenizer_config(tmp_path):
    """Conventional names tokenizer.json declares; no pad token: pad is eos."""
    folder = tmp_path / "bare"
    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, "<unk>"))
    raw.add_special_tokens(["<s>", "</s>"])
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    tokenizer = HFTokenizer.load(folder)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.unk_id) == (3, 4, 4, 2)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1}, "a"))
    raw.save(str(folder / "tokenizer.json"))
    tokenizer = HFTokenizer.load(folder)  # the model's config.json; bos and pad fall back to eos
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 1, 1)
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="names no eos token"):
        HFTokenizer.load(folder)


def test_bad_tokenizer_values_are_one_line_config_errors(tmp_path):
    text = dict(kind="text", path=str(tmp_path / "a.txt"), text_unit="line")
    with pytest.raises(ConfigError, match=r"^data.tokenizer='hf:/missing' must name a Hugging "
                       r"Face folder holding tokenizer.json \(hf:DIR\); /missing/tokenizer.json "
                       r"does not exist$"):
        DataConfig(**text, tokenizer="hf:/missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="data.tokenizer='hf:.*empty' must name a Hugging Face"):
        DataConfig(**text, tokenizer=f"hf:{tmp_path / 'empty'}")
    with pytest.raises(ConfigError, match="choose one of: byte, char, sentencepiece, hf:DIR"):
        DataConfig(**text, tokenizer="gpt2")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    (tmp_path / "a.txt").write_text(TEXT)
    with pytest.raises(ConfigError, match=r"^data.tokenizer='hf:.*broken' cannot be used: "):
        build_data(dict(**text, tokenizer=f"hf:{tmp_path / 'broken'}",
                        data_dir=str(tmp_path / "data")))


def test_tokenizer_identity_changes_with_tokenizer_json(bpe_folder, tmp_path):
    first = HFTokenizer.load(bpe_folder)
    assert HFTokenizer.load(bpe_folder).fingerprint == first.fingerprint
    write_bpe(bpe_folder, ["zzz yyy xxx", "qqq"])  # another tokenizer.json in the same folder
    second = HFTokenizer.load(bpe_folder)
    assert second.fingerprint != first.fingerprint and second != first


def test_text_lm_rows_decode_back_to_the_file(bpe_folder, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    data = build_data(dict(kind="text", path=str(corpus), text_unit="line", seq_len=64,
                           tokenizer=f"hf:{bpe_folder}", data_dir=str(tmp_path / "data")))
    tokenizer = HFTokenizer.load(bpe_folder)
    assert data.tokenizer == tokenizer and data.vocab_size == tokenizer.vocab_size
    [example] = data.eval_examples("validation")  # the last of the three lines
    assert example["inputs"][0] == tokenizer.bos_id and example["targets"][-1] == tokenizer.eos_id
    assert data.decode(example["targets"]) == TEXT.splitlines()[-1]
    batch = next(data.train_iterator())
    assert batch["inputs"].max() < data.vocab_size


def test_translation_uses_the_tokenizer_ids_on_both_sides(bpe_folder, tmp_path):
    source, target = tmp_path / "src.txt", tmp_path / "tgt.txt"
    lines = TEXT.splitlines()
    source.write_text("\n".join(lines * 4) + "\n")
    target.write_text("\n".join(reversed(lines * 4)) + "\n")
    data = build_data(dict(kind="parallel", source_path=str(source), target_path=str(target),
                           tokenizer=f"hf:{bpe_folder}", shared_vocab=False, seq_len=64,
                           validation_fraction=0.25, data_dir=str(tmp_path / "data")))
    tokenizer = data.tokenizer
    assert data.source_tokenizer == tokenizer and data.source_vocab_size == tokenizer.vocab_size
    sources, targets = data.eval_texts("validation")
    example = data.eval_examples("validation")[0]
    assert example["source"].tolist() == [*tokenizer.encode(sources[0]), tokenizer.eos_id]
    assert example["inputs"][0] == tokenizer.bos_id
    assert data.decode(example["targets"]) == targets[0]


# ---------------------------------------------------------- a pretrained model's own tokenizer


def _gpt2_copy(tmp_path: Path) -> Path:
    """The tiny GPT-2 fixture: vocab 64, word-level tokenizer.json over w0 ... w63, eos 63 (only
    in config.json), 16 positions."""
    folder = tmp_path / "gpt2"
    shutil.copytree(FIXTURES / "gpt2", folder)
    return folder


def _finetune_config(tmp_path: Path, folder: Path, tokenizer_folder: Path):
    from configs import char_lm

    corpus = tmp_path / "words.txt"
    corpus.write_text("".join(f"w{i} w{i + 1} w{i + 2}\n" for i in range(40)))
    config = char_lm.get_config("runlocal")
    config.data.update(path=str(corpus), text_unit="line", seq_len=16, eval_seq_len=16,
                       batch_size=8, eval_batch_size=8, tokenizer=f"hf:{tokenizer_folder}",
                       data_dir=str(tmp_path / "data"))
    config.optimizer.update(total_steps=3, warmup_steps=1)
    config.train.update(num_steps=3, log_every=1, eval_every=0, checkpoint_every=3,
                        progress_bar=False)
    config.eval.max_batches = 1
    config.generate.max_new_tokens = 4  # the fixture has 16 learned positions
    config.init.pretrained = str(folder)
    return config


def test_finetuning_uses_the_model_vocabulary(tmp_path):
    from tfm.training import train
    from tfm.training.experiment import setup

    folder = _gpt2_copy(tmp_path)
    config = _finetune_config(tmp_path, folder, folder)
    experiment = setup(config, tmp_path / "setup")
    assert experiment.model_config.vocab_size == experiment.data.vocab_size == 64
    assert experiment.data.tokenizer.eos_id == 63
    [example] = experiment.data.eval_examples("validation")[:1]
    assert experiment.data.decode(example["targets"]) == "w36 w37 w38"
    result = train.train_and_evaluate(config, tmp_path / "run")
    assert math.isfinite(result["eval_loss"])


def test_a_tokenizer_larger_than_the_model_is_one_line(tmp_path):
    from tfm.training.experiment import setup

    folder, bigger = _gpt2_copy(tmp_path), tmp_path / "bigger"
    bigger.mkdir()
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(80)}, "w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(bigger / "tokenizer.json"))
    (bigger / "config.json").write_text(json.dumps({"eos_token_id": 79}))
    with pytest.raises(ConfigError, match=r"^init.pretrained='.*gpt2' has vocab_size=64, smaller "
                       r"than data.tokenizer='hf:.*bigger' \(80 ids\)$"):
        setup(_finetune_config(tmp_path, folder, bigger), tmp_path / "run")


def test_generate_pretrained_encodes_and_decodes_with_the_same_class(tmp_path):
    tokenizer = hf.load_tokenizer(FIXTURES / "gpt2")
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_id == 63
    [text] = hf.generate_pretrained(FIXTURES / "gpt2", ["w5 w6 w7"], max_new_tokens=4)
    [ids] = hf.generate_pretrained(FIXTURES / "gpt2", [" ".join(map(str, tokenizer.encode(
        "w5 w6 w7")))], max_new_tokens=4, prompt_ids=True)
    assert text == tokenizer.decode(int(i) for i in ids.split())
    assert text and all(word.startswith("w") for word in text.split())
