"""Data: tfds builders (no TensorFlow needed), tokenizers and grain pipelines.

Entry point: `build_data(config.data, process_index, process_count) -> Data` (see build.py for the
config fields). Batch formats and special token ids (pad 0, bos 1, eos 2) follow the API contract.
"""

from pathlib import Path

from tfm.data.build import Data, build_data
from tfm.data.builders import DataError
from tfm.data.config import DataConfig
from tfm.data.pipeline import checkpoint_restore_args, checkpoint_save_args
from tfm.data.tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
)

# Data that ships with the package (pyproject package-data): tinyshakespeare.txt (1.1 MB, the
# Shakespeare text of Karpathy's char-rnn), the default corpus of configs/char_lm.py.
ASSETS = Path(__file__).resolve().parent / "assets"

__all__ = [
    "ASSETS",
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "ByteTokenizer",
    "CharTokenizer",
    "Data",
    "DataConfig",
    "DataError",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "build_data",
    "checkpoint_restore_args",
    "checkpoint_save_args",
]
