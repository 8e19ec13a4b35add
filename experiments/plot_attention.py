"""Pictures: attention maps of a trained model, and what each position scheme looks like.

    # Attention per layer and head for one input, from a checkpoint (the model's greedy output
    # is appended, so the map shows the answer being written):
    python experiments/plot_attention.py attention configs/synthetic_lm.py:reverse,alibi \
        --workdir workdirs/synthetic_lm_reverse_alibi --input 1234567 \
        --out experiments/results/attention_synthetic_lm_reverse_alibi.png
    # The position schemes themselves (no checkpoint): sinusoidal position similarity,
    # ALiBi biases per head, T5 bucketed biases (random-initialised bucket values) and buckets:
    python experiments/plot_attention.py positions --out_dir experiments/results

Overrides of the training run go after the config as for ./launch.sh (--config.x=y). Weights come
from the reference attention backend (it returns them): every tfm.kernels.attention call is
recorded with the path of the module that made it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import jax  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tfm import kernels  # noqa: E402
from tfm.nn import positions  # noqa: E402
from tfm.training.evaluate import decode_texts  # noqa: E402
from tfm.training.experiment import model_for, restore_params, setup  # noqa: E402


@contextlib.contextmanager
def recorded_attention() -> Iterator[list[tuple[str, Any]]]:
    """Within the block, every attention call also returns its weights, recorded as (module
    path, weights [batch, heads, q_len, kv_len]); the model sees the usual output. Inside jit
    the weights are tracers: return them (`attention_weights` does). Layers must be unrolled
    (model.scan_layers=False)."""
    from flax.linen.module import _context

    original = kernels.attention
    records: list[tuple[str, Any]] = []

    def recording(*args, **kwargs):
        wanted = kwargs.get("return_weights", False)
        kwargs.update(return_weights=True, backend="reference", cache_layout=False)
        out, weights = original(*args, **kwargs)
        module = _context.module_stack[-1] if _context.module_stack else None
        path = "/".join(module.path) if module is not None and module.scope else "attention"
        records.append((path, weights))
        return (out, weights) if wanted else out

    kernels.attention = recording
    try:
        yield records
    finally:
        kernels.attention = original


def attention_weights(model, variables, *inputs) -> list[tuple[str, np.ndarray]]:
    """(module path, weights [batch, heads, q_len, kv_len]) of every attention call of
    `model.apply(variables, *inputs)`, in call order (one compilation, not op by op)."""
    paths: list[str] = []

    def forward(variables, *inputs):
        with recorded_attention() as records:
            model.apply(variables, *inputs)
        paths[:] = [path for path, _ in records]
        return [weights for _, weights in records]

    weights = jax.jit(forward)(variables, *inputs)
    return [(path, np.asarray(w)) for path, w in zip(paths, weights, strict=True)]


def _token_labels(tokenizer, ids) -> list[str]:
    names = {0: "<pad>", 1: "<s>", 2: "</s>"}
    return [names.get(int(i)) or tokenizer.decode([int(i)]) or f"<{int(i)}>" for i in ids]


def model_attention(config_arg: str, overrides: list[str], workdir: str, text: str,
                    step: int | None) -> tuple[list[tuple[str, np.ndarray]], dict]:
    """(records, labels) for `text` through the checkpoint in `workdir`; labels has "query"
    and "key" token labels per record kind ("self", "cross", "encoder")."""
    import jax.numpy as jnp
    from absl import flags
    from ml_collections import config_flags

    from tfm.data.tokenizers import BOS_ID

    config_flags.DEFINE_config_file("config")
    flags.FLAGS([sys.argv[0], f"--config={config_arg}", *overrides])
    config = flags.FLAGS.config
    experiment = setup(config, workdir)
    params, _ = restore_params(experiment, step)
    data = experiment.data
    output = decode_texts(experiment, params, [text], method="greedy",
                                max_new_tokens=None if experiment.mode == "seq2seq" else 64)[0]
    model_config = dataclasses.replace(experiment.model_config, attention_backend="reference",
                                       scan_layers=False)
    if experiment.model_config.scan_layers:
        raise SystemExit("plot_attention: train with model.scan_layers=False to plot per layer")
    model = model_for(model_config, experiment.mode)
    prompt = data.encode_prompt(text)
    target = data.tokenizer.encode(output)
    variables = {"params": params}
    if experiment.mode == "seq2seq":
        inputs = [BOS_ID, *target]
        records = attention_weights(model, variables, jnp.asarray([prompt]), jnp.asarray([inputs]))
        source_labels = _token_labels(data.source_tokenizer or data.tokenizer, prompt)
        target_labels = _token_labels(data.tokenizer, inputs)
        labels = {"encoder": (source_labels, source_labels),
                  "self": (target_labels, target_labels), "cross": (target_labels, source_labels)}
    else:
        tokens = [*prompt, *target]
        records = attention_weights(model, variables, jnp.asarray([tokens]))
        token_labels = _token_labels(data.tokenizer, tokens)
        labels = {"self": (token_labels, token_labels)}
    print(f"{text!r} -> {output!r}")
    return records, labels


def _kind(path: str) -> str:
    if path.startswith("encoder") or "/encoder" in path:
        return "encoder"
    return "cross" if "cross" in path else "self"


def plot_attention_maps(records, labels, title: str, out: Path) -> None:
    """A grid: a row per attention call (layer and kind), a column per head."""
    heads = max(weights.shape[1] for _, weights in records)
    size = 2.2
    figure, axes = plt.subplots(len(records), heads, figsize=(size * heads, size * len(records)),
                                squeeze=False)
    for row, (path, weights) in enumerate(records):
        query_labels, key_labels = labels[_kind(path)]
        for head in range(heads):
            axis = axes[row][head]
            if head >= weights.shape[1]:
                axis.axis("off")
                continue
            axis.imshow(weights[0, head], cmap="viridis", vmin=0.0, vmax=1.0)
            axis.set_xticks(range(len(key_labels)), key_labels, fontsize=5)
            axis.set_yticks(range(len(query_labels)), query_labels, fontsize=5)
            axis.tick_params(length=0)
            if row == 0:
                axis.set_title(f"head {head}", fontsize=8)
            if head == 0:
                axis.set_ylabel(path.removeprefix("params/"), fontsize=6)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    print(f"wrote {out}")


def plot_positions(out_dir: Path, length: int = 64, d_model: int = 128, num_heads: int = 8
                   ) -> list[Path]:
    """The sinusoidal similarity matrix, ALiBi biases per head, T5 biases and buckets."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = np.arange(length)
    written = []

    # Sinusoidal (Vaswani et al. 2017, sec. 3.5): cosine similarity of the position vectors.
    table = np.asarray(positions.sinusoidal(ids, d_model))  # [length, d_model]
    unit = table / np.linalg.norm(table, axis=-1, keepdims=True)
    figure, axis = plt.subplots(figsize=(5, 4.3))
    image = axis.imshow(unit @ unit.T, cmap="RdBu_r", vmin=-1, vmax=1)
    axis.set_xlabel("position")
    axis.set_ylabel("position")
    axis.set_title(f"sinusoidal positions: cosine similarity (d_model {d_model})", fontsize=9)
    figure.colorbar(image)
    figure.tight_layout()
    written.append(out_dir / "positions_sinusoidal_similarity.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)

    # ALiBi (Press et al. 2022): bias = -slope_h * distance, causal.
    slopes = positions.alibi_slopes(num_heads)
    bias = np.asarray(positions.alibi_bias(ids[None], ids[None], slopes))[0]  # [H, q, k]
    causal = ids[:, None] >= ids[None, :]
    written.append(out_dir / "positions_alibi.png")
    _head_grid(np.where(causal, bias, np.nan), [f"head {h}: slope {s:.3g}" for h, s in
                                                enumerate(slopes)],
               f"ALiBi bias (query x key, causal, {num_heads} heads)", written[-1])

    # T5 (Raffel et al. 2020): bucketed relative distances, one learned scalar per bucket and head.
    num_buckets, max_distance = 32, 128
    relative = ids[None, :] - ids[:, None]  # key - query
    for bidirectional in (False, True):
        buckets = np.asarray(positions.t5_relative_bucket(
            relative, bidirectional=bidirectional, num_buckets=num_buckets,
            max_distance=max_distance))
        kind = "bidirectional (encoder)" if bidirectional else "causal (decoder)"
        figure, axis = plt.subplots(figsize=(5, 4.3))
        image = axis.imshow(np.where(causal | bidirectional, buckets, np.nan), cmap="tab20b")
        axis.set_xlabel("key position")
        axis.set_ylabel("query position")
        axis.set_title(f"T5 relative buckets, {kind}\n({num_buckets} buckets, max distance "
                       f"{max_distance}: exact up to {num_buckets // (4 if bidirectional else 2)},"
                       " then logarithmic)", fontsize=8)
        figure.colorbar(image)
        figure.tight_layout()
        side = "bidirectional" if bidirectional else "causal"
        written.append(out_dir / f"positions_t5_buckets_{side}.png")
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)
    for path in written:
        print(f"wrote {path}")
    return written


def _head_grid(maps: np.ndarray, titles: list[str], title: str, out: Path) -> None:
    columns = 4
    rows = -(-len(maps) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3 * columns, 3 * rows), squeeze=False)
    # One colour scale for all heads, so their slopes compare.
    low, high = np.nanmin(maps), np.nanmax(maps)
    for index, axis in enumerate(axes.flat):
        if index >= len(maps):
            axis.axis("off")
            continue
        image = axis.imshow(maps[index], cmap="magma", vmin=low, vmax=high)
        axis.set_title(titles[index], fontsize=8)
        axis.set_xticks([])
        axis.set_yticks([])
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    maps = commands.add_parser("attention", help="attention maps from a checkpoint")
    maps.add_argument("config", help="configs/FILE.py[:ARG], as trained")
    maps.add_argument("--workdir", required=True)
    maps.add_argument("--input", required=True, help="the prompt (LM) or source (seq2seq)")
    maps.add_argument("--step", type=int, default=None)
    maps.add_argument("--out", default=None)
    pictures = commands.add_parser("positions", help="the position schemes, no checkpoint")
    pictures.add_argument("--out_dir", default=str(ROOT / "experiments" / "results"))
    pictures.add_argument("--length", type=int, default=64)
    args, overrides = parser.parse_known_args()
    if args.command == "positions":
        plot_positions(Path(args.out_dir), args.length)
        return
    records, labels = model_attention(args.config, overrides, args.workdir, args.input, args.step)
    name = Path(args.workdir.rstrip("/")).name
    out = Path(args.out or ROOT / "experiments" / "results" / f"attention_{name}.png")
    plot_attention_maps(records, labels, f"{args.config} {' '.join(overrides)}\ninput "
                        f"{args.input!r}", out)


if __name__ == "__main__":
    main()
