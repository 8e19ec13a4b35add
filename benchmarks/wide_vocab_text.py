"""Writes a text whose character vocabulary has exactly VOCAB ids, so that `configs/char_lm.py`
builds a model with a GPT-2-sized output layer (50,304 = GPT-2's 50,257 tokens padded to a
multiple of 64, as nanoGPT does) for compile reports, without a tokenizer download:

    python benchmarks/wide_vocab_text.py /tmp/wide_vocab.txt --vocab 50304
    ./launch.sh compile configs/char_lm.py --target v5e-8 --config.data.path=/tmp/wide_vocab.txt ...

The text is VOCAB - 5 distinct CJK-and-onward code points (surrogates skipped), in lines of 100
and paragraphs of 5 lines, repeated 3 times; with the newline and the char tokenizer's 4
special ids that is VOCAB. Only the vocabulary size matters to a compile; the text is not
language.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tfm.data.tokenizers import CharTokenizer

FIRST_CODE_POINT = 0x4E00
SURROGATES = range(0xD800, 0xE000)


def wide_vocab_text(vocab_size: int) -> str:
    count = vocab_size - 5  # the newline and pad, bos, eos, unk
    points = (p for p in range(FIRST_CODE_POINT, 0x110000) if p not in SURROGATES)
    characters = [chr(next(points)) for _ in range(count)]
    lines = ["".join(characters[i:i + 100]) for i in range(0, count, 100)]
    paragraphs = ["\n".join(lines[i:i + 5]) for i in range(0, len(lines), 5)]
    return "\n\n".join(paragraphs * 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--vocab", type=int, default=50304)
    args = parser.parse_args()
    if args.vocab < 6:
        parser.error(f"--vocab={args.vocab} must be at least 6")
    text = wide_vocab_text(args.vocab)
    built = CharTokenizer.from_texts([text]).vocab_size
    if built != args.vocab:
        raise SystemExit(f"the char tokenizer built {built} ids, not {args.vocab}")
    args.path.write_text(text, encoding="utf-8")
    print(f"wrote {args.path}: {len(text):,} characters, char vocabulary {built:,}")


if __name__ == "__main__":
    main()
