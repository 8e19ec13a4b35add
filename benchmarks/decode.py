"""Greedy decoding speed (tokens/s) with the KV cache vs recomputing the whole prefix every step.

    python benchmarks/decode.py                       # 256 and 1,024 tokens, batch 1 and 8
    python benchmarks/decode.py --new-tokens 32 --batches 1 --repeats 1   # a quick try

Same model, same process: a small LM (6 layers, d_model 384, 6 heads, d_ff 1536, vocab 256,
random init, float32), prompts of 8 random tokens.

- cached: `tfm.decode.generate.lm_generate(method="greedy")`: prefill, then one token per step
against
  the KV cache, the whole loop in one jit. It generates every token: the EOS id is one the model
  never emits on these prompts (checked: every row must reach `new_tokens`).
- recompute: one jit holding a fixed [batch, prompt + new_tokens] token buffer; every step runs
  the full DecoderLM forward (no cache) over the whole buffer and writes the argmax at the current
  position into it (positions past it are pad, masked and causally invisible). Its cost per step
  does not depend on the step, so by default it times `--recompute-steps` steps (not the whole
  generation, which would take far too long on a small CPU) and reports tokens/s from them.

Both are compiled ahead of time (compile excluded; lm_generate's executable is compiled without
running it, see `compile_lm_generate`); each figure is the median of `--repeats` timed calls
ended with block_until_ready, fewer (at least one) where the next call would pass `--budget-s`.
Writes benchmarks/results/decode.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from tfm.decode import generate
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM

ROOT = Path(__file__).resolve().parents[1]

PROMPT_LEN = 8
FIRST_EOS = 2


def model_config(position_scheme: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=256,
        d_model=384,
        num_heads=6,
        d_ff=1536,
        num_encoder_layers=0,
        num_decoder_layers=6,
        dropout_rate=0.0,
        position_scheme=position_scheme,
        max_len=2048,
        dtype="float32",
    )


@functools.partial(jax.jit, static_argnames=("config",))
def recompute_greedy(params, buffer, start, num_steps, config):
    """Greedy without a cache: buffer [batch, total] holds the prompt in [0, start); each of
    `num_steps` steps runs the model over the whole buffer and writes the argmax of position
    `start + i - 1` at `start + i`. Returns the buffer."""
    model = DecoderLM(config)

    def step(i, buffer):
        position = start + i
        logits = model.apply({"params": params}, buffer)  # [batch, total, vocab]
        last = jax.lax.dynamic_index_in_dim(logits, position - 1, axis=1, keepdims=False)
        token = jnp.argmax(last, axis=-1).astype(jnp.int32)
        return jax.lax.dynamic_update_index_in_dim(buffer, token, position, axis=1)

    return jax.lax.fori_loop(0, num_steps, step, buffer)


def timed(fn, repeats: int, budget_s: float) -> tuple[float, list[float], object]:
    """Median seconds over calls of fn (compiled already): `repeats` calls, fewer (at least one)
    when the next would end past `budget_s`. Returns the median, all times, the last result."""
    times = []
    while len(times) < repeats and (not times or sum(times) + max(times) <= budget_s):
        start = time.perf_counter()
        result = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, result


def compile_lm_generate(*args, **kwargs):
    """Compiles, without running it, the executable `lm_generate(*args, **kwargs)` would run, and
    returns it as a no-argument callable. lm_generate validates the request and builds the jitted
    call as usual; the call is captured instead of run, so a warm-up does not cost a whole
    generation (at 1,024 tokens it takes minutes here)."""
    captured = []
    jitted = generate._lm_generate_jit
    with mock.patch.object(generate, "_lm_generate_jit", lambda *a: captured.append(a)):
        generate.lm_generate(*args, **kwargs)
    (call_args,) = captured
    compiled = jitted.lower(*call_args).compile()
    dynamic = call_args[:4]  # params, prompts, prompt_lengths, rng; the rest are static
    return lambda: compiled(*dynamic)


def measure_cached(params, config, prompts, new_tokens: int, repeats: int, budget_s: float):
    """lm_generate greedy, all `new_tokens` generated (an EOS id the model never emits)."""
    batch = prompts.shape[0]
    lengths = np.full((batch,), PROMPT_LEN, np.int32)
    eos_id = FIRST_EOS
    for _ in range(8):
        start = time.perf_counter()
        run = compile_lm_generate(
            params, config, prompts, lengths, max_new_tokens=new_tokens, eos_id=eos_id
        )
        compile_s = time.perf_counter() - start
        seconds, times, output = timed(run, repeats, budget_s)
        if np.all(np.asarray(output.lengths) == new_tokens):
            break
        # Greedy does not depend on eos_id until it stops: pick an id absent from what it made.
        emitted = set(np.asarray(output.tokens).ravel().tolist())
        eos_id = next(t for t in range(3, config.vocab_size) if t not in emitted)
    else:
        raise RuntimeError("could not find an EOS id the model never emits")
    return dict(
        seconds=seconds,
        times=times,
        tokens_per_second=batch * new_tokens / seconds,
        compile_s=compile_s,
        eos_id=eos_id,
        tokens=np.asarray(output.tokens),
    )


def measure_recompute(params, config, prompts, new_tokens, steps, repeats, budget_s) -> dict:
    batch = prompts.shape[0]
    buffer = np.zeros((batch, PROMPT_LEN + new_tokens), np.int32)
    buffer[:, :PROMPT_LEN] = prompts
    args = (params, jnp.asarray(buffer), PROMPT_LEN, steps)
    start = time.perf_counter()
    compiled = recompute_greedy.lower(*args, config).compile()
    compile_s = time.perf_counter() - start
    seconds, times, result = timed(lambda: compiled(*args), repeats, budget_s)
    return dict(
        seconds=seconds,
        times=times,
        steps_timed=steps,
        tokens_per_second=batch * steps / seconds,
        compile_s=compile_s,
        tokens=np.asarray(result)[:, PROMPT_LEN : PROMPT_LEN + steps],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", default="256,1024")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--recompute-steps", type=int, default=32,
        help="recompute steps timed per call (0 = all new tokens)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=60.0,
        help="fewer repeats (at least one) where the next would pass this many seconds",
    )
    parser.add_argument("--position-scheme", default="rope")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    command = "python benchmarks/decode.py " + " ".join(sys.argv[1:])

    config = model_config(args.position_scheme)
    started = time.perf_counter()
    params = jax.jit(DecoderLM(config).init)(
        jax.random.PRNGKey(args.seed), jnp.zeros((1, PROMPT_LEN), jnp.int32)
    )["params"]
    num_params = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(args.seed)
    print(f"{num_params / 1e6:.2f}M parameters, {jax.devices()[0].device_kind}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)

    rows = []
    for new_tokens in [int(n) for n in args.new_tokens.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = rng.integers(3, config.vocab_size, (batch, PROMPT_LEN)).astype(np.int32)
            cached = measure_cached(
                params, config, prompts, new_tokens, args.repeats, args.budget_s
            )
            steps = min(args.recompute_steps or new_tokens, new_tokens)
            recompute = measure_recompute(
                params, config, prompts, new_tokens, steps, args.repeats, args.budget_s
            )
            agreement = float(np.mean(cached["tokens"][:, :steps] == recompute["tokens"]))
            row = dict(
                new_tokens=new_tokens,
                batch=batch,
                cached_tokens_per_second=cached["tokens_per_second"],
                recompute_tokens_per_second=recompute["tokens_per_second"],
                speedup=cached["tokens_per_second"] / recompute["tokens_per_second"],
                cached_seconds=cached["seconds"],
                cached_times=cached["times"],
                cached_compile_s=cached["compile_s"],
                recompute_steps_timed=steps,
                recompute_seconds=recompute["seconds"],
                recompute_times=recompute["times"],
                recompute_compile_s=recompute["compile_s"],
                eos_id=cached["eos_id"],
                greedy_agreement_on_timed_steps=agreement,
            )
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("times")}),
                  flush=True)

    partial = any(r["recompute_steps_timed"] < r["new_tokens"] for r in rows)
    lines = [
        "# Greedy decoding: KV cache vs full recomputation",
        "",
        f"Model: DecoderLM, 6 layers, d_model 384, 6 heads, d_ff 1536, vocab 256, "
        f"{args.position_scheme} positions, float32, random init ({num_params / 1e6:.2f}M "
        f"parameters); prompts of {PROMPT_LEN} tokens. Machine: {platform.machine()}, "
        f"{os.cpu_count()} CPU cores ({jax.devices()[0].device_kind}, shared, noisy), 1-minute "
        f"load average {os.getloadavg()[0]:.1f} when written. Each figure is the median of "
        f"up to {args.repeats} timed calls (fewer, at least one, where the next call would have "
        f"passed {args.budget_s:.0f} s; `runs` says how many), compilation excluded.",
        "",
        "| new tokens | batch | cached tok/s | recompute tok/s | ratio | cached runs | "
        "recompute steps timed x runs |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['new_tokens']:,} | {r['batch']} | {r['cached_tokens_per_second']:,.1f} | "
            f"{r['recompute_tokens_per_second']:,.2f} | {r['speedup']:,.1f}x | "
            f"{len(r['cached_times'])} | {r['recompute_steps_timed']:,} x "
            f"{len(r['recompute_times'])} |"
        )
    lines.append("")
    lines.append(
        "cached: tfm.decode.generate.lm_generate(method='greedy'), all new tokens generated "
        "(every row "
        "reached the full length). recompute: one jitted loop over a fixed [batch, "
        f"{PROMPT_LEN} + new tokens] buffer, the full forward pass over the whole buffer each step."
    )
    if partial:
        lines.append(
            "The recompute baseline was timed on the first `recompute steps timed` steps only, "
            "not the whole generation: its per-step cost is constant (the buffer has a fixed "
            "size), so tokens/s = batch x steps / time is its rate for the whole generation."
        )
    agreement = min(r["greedy_agreement_on_timed_steps"] for r in rows)
    lines.append(
        "Fraction of the recompute baseline's greedy tokens equal to the cached path's on the "
        f"timed steps: {agreement:.3f} (lowest over the rows of the table)."
    )
    lines.append(f"Whole run: {time.perf_counter() - started:.0f} s.")
    lines.append("")
    lines.append(f"Command: `{command.strip()}`")
    report = "\n".join(lines)
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = dict(
        command=command.strip(),
        model=dict(
            num_decoder_layers=6, d_model=384, num_heads=6, d_ff=1536, vocab_size=256,
            position_scheme=args.position_scheme, dtype="float32", num_params=num_params,
        ),
        prompt_len=PROMPT_LEN,
        repeats=args.repeats,
        budget_s=args.budget_s,
        recompute_note=(
            "recompute tokens/s measured on recompute_steps_timed steps of a fixed-size buffer "
            "(constant cost per step), not on the whole generation" if partial else
            "recompute baseline generated every token"
        ),
        device=jax.devices()[0].device_kind,
        cpu_count=os.cpu_count(),
        load_average_1min=os.getloadavg()[0],
        rows=rows,
    )
    (out / "decode.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "decode.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
