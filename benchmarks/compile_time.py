"""Compile time against depth: the train step and the greedy decode loop, 6 vs 24 layers.

    python benchmarks/compile_time.py                   # scan_layers=True and unrolled
    python benchmarks/compile_time.py --layers 6,12,24 --modes scan

With `scan_layers=True` (nn.scan over the blocks) the compiled program holds one block, so
compile time should stay flat in depth; unrolled stacks grow with it. Each figure is the wall
time of `jit(...).lower(...).compile()` on the char-GPT shape of benchmarks/vs_torch.py
(d_model 384, 6 heads, block 256, batch 8; decoding: 8-token prompts, 256 new tokens, the
default DecodeConfig.cache_segments (4 loops of 64 steps) and one loop, cache_segments=1).
Writes benchmarks/results/compile_time.{json,md}.

    python benchmarks/compile_time.py --modes unrolled --layers 6 --compilation_cache_dir DIR \
        --out benchmarks/results/compile_cache    # twice: cold, then with the cache warm

--compilation_cache_dir turns on jax's persistent compilation cache there (what
`train.compilation_cache_dir` does): a second run loads the compiled programs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tfm.data.tokenizers import EOS_ID
from tfm.decode import generate
from tfm.decode.search import DecodeConfig
from tfm.kernels import cpu_compile, hardware
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM
from tfm.training import train
from tfm.training.experiment import TrainState

ROOT = Path(__file__).resolve().parents[1]


def config_for(layers: int, scan: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=65, d_model=384, num_heads=6, d_ff=1536, num_encoder_layers=0,
        num_decoder_layers=layers, dropout_rate=0.2, position_scheme="learned", max_len=512,
        norm_placement="pre", activation="gelu", use_bias=False, scale_embeddings=False,
        scan_layers=scan,
    )


def train_compile_seconds(config: ModelConfig, batch: int = 8, block: int = 256) -> float:
    model = DecoderLM(config)
    optimizer = optax.adamw(1e-3)
    tokens = jnp.zeros((batch, block), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens)["params"])
    params = jax.tree.map(lambda x: getattr(x, "value", x), params,
                          is_leaf=lambda x: hasattr(x, "value"))
    state = TrainState(jnp.zeros((), jnp.int32), params,
                             jax.eval_shape(optimizer.init, params), jax.random.PRNGKey(1))
    data = {"inputs": tokens, "targets": tokens, "weights": jnp.ones(tokens.shape),
            "positions": tokens, "segment_ids": tokens + 1}
    step = jax.jit(lambda s, b: train.train_step(
        s, b, model=model, mode="lm", optimizer=optimizer,
        schedule=optax.constant_schedule(1e-3), label_smoothing=0.0))
    start = time.perf_counter()
    step.lower(state, data).compile()
    return time.perf_counter() - start


def decode_compile_seconds(config: ModelConfig, batch: int = 1, new_tokens: int = 256,
                           cache_segments: int = DecodeConfig.cache_segments) -> float:
    config = config.replace(dropout_rate=0.0)
    params = jax.eval_shape(
        lambda: DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    )["params"]
    params = jax.tree.map(lambda x: getattr(x, "value", x), params,
                          is_leaf=lambda x: hasattr(x, "value"))
    decode = DecodeConfig("greedy", max_new_tokens=new_tokens, cache_segments=cache_segments)
    start = time.perf_counter()
    generate._lm_generate_jit.lower(
        params, jnp.zeros((batch, 8), jnp.int32), jnp.full((batch,), 8), jax.random.PRNGKey(0),
        config, decode, EOS_ID,
    ).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="6,24")
    parser.add_argument("--modes", default="scan,unrolled")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--compilation_cache_dir", default=None)
    args = parser.parse_args()
    cache_note = "Persistent compilation cache: off."
    if args.compilation_cache_dir:
        cache = cpu_compile.use_compilation_cache(args.compilation_cache_dir)
        cache_note = (f"Persistent compilation cache: on, {len(list(cache.iterdir()))} entries "
                      "in its folder when this run started.")
    depths = [int(n) for n in args.layers.split(",")]
    rows = []
    for mode in args.modes.split(","):
        for layers in depths:
            config = config_for(layers, mode == "scan")
            row = {"mode": mode, "layers": layers,
                   "train_compile_s": train_compile_seconds(config),
                   "decode_compile_s": decode_compile_seconds(config),
                   "decode_one_loop_compile_s": decode_compile_seconds(config, cache_segments=1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    cpu = hardware.cpu_features()
    title = f"# Compile time vs depth ({cpu['model']}, {cpu['cores']} cores, jax {jax.__version__})"
    lines = [title, "", cache_note, "",
             "| stack | layers | train step compile (s) | decode loops compile (s) | "
             "decode, one loop (s) |", "|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['mode']} | {row['layers']} | {row['train_compile_s']:.1f} | "
                     f"{row['decode_compile_s']:.1f} | {row['decode_one_loop_compile_s']:.1f} |")
    for mode in args.modes.split(","):
        mine = [r for r in rows if r["mode"] == mode]
        if len(mine) > 1:
            keys = ("train_compile_s", "decode_compile_s", "decode_one_loop_compile_s")
            ratio = {k: mine[-1][k] / mine[0][k] for k in keys}
            lines.append(f"\n{mode}: {mine[-1]['layers']} layers / {mine[0]['layers']} layers = "
                         f"{ratio['train_compile_s']:.2f}x (train), "
                         f"{ratio['decode_compile_s']:.2f}x (decode), "
                         f"{ratio['decode_one_loop_compile_s']:.2f}x (decode, one loop)")
    lines.append(f"\nCommand: `python benchmarks/compile_time.py {' '.join(sys.argv[1:])}`")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_time.json").write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    (out / "compile_time.md").write_text(text + "\n")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
