"""tfm's CPU compile options (tfm/kernels/cpu_compile.py) against the alternatives, side by side.

    python benchmarks/xla_options.py                    # about 8 minutes on 2 cores
    python benchmarks/xla_options.py --gpt_microbatches ""  --repeats 5   # without the 6-layer step
    python benchmarks/xla_options.py --settings "no YNNPACK,no YNNPACK -O1"
    python benchmarks/xla_options.py --config configs/char_lm.py:small,bf16 \
        --gpt_microbatches "" --decode_batches "" --settings "no YNNPACK,YNNPACK dots"

Each piece of work runs under every setting in one process, repeats interleaved, medians kept:
- "XLA defaults": jaxlib's own choice (YNNPACK takes dots and reductions);
- "YNNPACK dots": only individual dots go to YNNPACK (`cpu_kernels="ynnpack_dots"`, what
  train.cpu_kernels="auto" takes for bfloat16 on a CPU with bf16 units);
- "no YNNPACK": XLA's own dots and reductions (tfm's choice, for every step);
- "no YNNPACK -O1": the same with LLVM at -O1 instead of -O3 (faster to compile; what
  parameter initialisation uses, cpu_compile.run_once_options); not in the default set;
- "oneDNN dots": XLA hands every dot to the oneDNN library (the rest as "no YNNPACK"; what a
  step's `cpu_kernels="onednn"` asks for, the `train.cpu_kernels` config field); not in the
  default set (benchmarks/README.md).
The work: the small char-LM recipe's train step (configs/char_lm.py:small, as `train.jit_steps`
builds it) and its eval step (`evaluate.jit_eval_step`, on its eval batches); the char-GPT train
step of vs_torch.py (6 layers, d_model 384, batch 64 x 256, dropout 0.2) at each of
--gpt_microbatches; greedy decoding with `lm_generate` on that model (8-token prompts,
--new_tokens, batch 1 and 8). Every setting's losses are printed: they agree to float32
rounding. Writes benchmarks/results/xla_options.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from char_gpt import SHAPE, init_params, model_config, random_batch, tfm_train_runner

from tfm.decode.generate import lm_generate
from tfm.kernels import cpu_compile, cpu_memory, hardware
from tfm.parallel import sharding
from tfm.sweeps.sweep import load_config
from tfm.training import train
from tfm.training.experiment import init_state, setup, state_shardings

ROOT = Path(__file__).resolve().parents[1]

YNN = cpu_compile.YNN_FUSION
ALL_SETTINGS: dict[str, dict | None] = {
    "XLA defaults": None,
    "YNNPACK dots": cpu_compile.YNNPACK_DOTS_OPTIONS,
    "no YNNPACK": {YNN: ""},
    "no YNNPACK -O1": {YNN: "", "xla_backend_optimization_level": 1},
    "oneDNN dots": cpu_compile.ONEDNN_OPTIONS,  # what cpu_kernels="onednn" asks for
}
DEFAULT_SETTINGS = "XLA defaults,YNNPACK dots,no YNNPACK"
TFM_CHOICE = "no YNNPACK"
SETTINGS: dict[str, dict | None] = {}  # the ones measured: --settings


def interleave(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median seconds of each setting's run(), the settings taking turns."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            with cpu_compile.using(SETTINGS[name]):
                times[name].append(run())
    return {name: statistics.median(values) for name, values in times.items()}


def recipe_steps(args) -> list[dict]:
    """The small recipe's train step (per step) and eval step (per batch)."""
    config = load_config(args.config)
    experiment = setup(config, Path("/tmp/tfm_xla_options"))
    _, shardings = state_shardings(experiment)
    iterator = experiment.data.train_iterator()
    batches = [sharding.shard_batch(next(iterator), experiment.mesh, rules=experiment.rules)
               for _ in range(args.steps)]
    eval_batches = [
        sharding.shard_batch(dict(batch), experiment.mesh, rules=experiment.rules)
        for batch, _ in zip(experiment.data.eval_batches(experiment.eval_splits[0]),
                            range(args.eval_batches), strict=False)
    ]
    train_step, eval_step = train.jit_steps(experiment, shardings)
    states, losses, eval_losses = {}, {}, {}
    for name in SETTINGS:
        with cpu_compile.using(SETTINGS[name]):
            states[name] = init_state(experiment, shardings)
            states[name], metrics = train_step(states[name], batches[0])  # compile
            losses[name] = float(metrics["loss_sum"])
            eval_losses[name] = float(eval_step(states[name].params, eval_batches[0])["loss_sum"])

    def train_run(name: str) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for batch in batches:
                states[name], metrics = train_step(states[name], batch)
            jax.block_until_ready(metrics)
            return (time.perf_counter() - start) / len(batches)
        return run

    def eval_run(name: str) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for batch in eval_batches:
                out = eval_step(states[name].params, batch)
            jax.block_until_ready(out)
            return (time.perf_counter() - start) / len(eval_batches)
        return run

    train_s = interleave({name: train_run(name) for name in SETTINGS}, args.repeats)
    eval_s = interleave({name: eval_run(name) for name in SETTINGS}, args.repeats)
    return [
        {"work": f"train step, {args.config}", "unit": "ms/step",
         "tokens": int(batches[0]["inputs"].size), "seconds": train_s, "first_loss_sum": losses},
        {"work": f"eval step, {args.config}", "unit": "ms/batch",
         "tokens": int(eval_batches[0]["inputs"].size), "seconds": eval_s,
         "first_loss_sum": eval_losses},
    ]


def gpt_train_steps(args) -> list[dict]:
    """vs_torch.py's char-GPT train step at each microbatch count."""
    batch = random_batch(SHAPE.batch, SHAPE.block)[0]
    rows = []
    for k in [int(k) for k in args.gpt_microbatches.split(",") if k]:
        runs = {}
        for name in SETTINGS:
            with cpu_compile.using(SETTINGS[name]):
                runs[name] = tfm_train_runner(SHAPE, "float32", batch, microbatches=k)[0]
        seconds = interleave({name: (lambda run=run: run(1)) for name, run in runs.items()},
                             args.gpt_repeats)
        rows.append({"work": f"train step, char GPT 6 x 384, batch 64 x 256, {k} microbatches",
                     "unit": "s/step", "tokens": SHAPE.batch * SHAPE.block, "seconds": seconds})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def decode_loops(args) -> list[dict]:
    config = model_config(SHAPE, "float32", 8 + args.new_tokens).replace(dropout_rate=0.0)
    params = init_params(config, prompt_len=8)
    rows = []
    for batch in [int(b) for b in args.decode_batches.split(",") if b]:
        prompts = np.random.default_rng(batch).integers(3, 65, (batch, 8))

        def run(prompts=prompts, batch=batch) -> float:
            start = time.perf_counter()
            out = lm_generate(params, config, prompts, np.full(batch, 8),
                              max_new_tokens=args.new_tokens, eos_id=2)
            jax.block_until_ready(out)
            return time.perf_counter() - start

        for name in SETTINGS:
            with cpu_compile.using(SETTINGS[name]):
                run()  # compile
        seconds = interleave(dict.fromkeys(SETTINGS, run), args.repeats)
        rows.append({"work": f"greedy decode, char GPT 6 x 384, batch {batch}, "
                             f"{args.new_tokens} new tokens", "unit": "tokens/s",
                     "tokens": batch * args.new_tokens, "seconds": seconds})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def report(info: dict, rows: list[dict], command: str) -> str:
    names = list(SETTINGS)
    baseline = names[0]
    versus = names[1:]
    lines = [
        "# tfm's XLA CPU options, side by side", "",
        f"CPU: {info['model']}, {info['cores']} cores; jax {jax.__version__}. tfm compiles its "
        f"steps with \"{TFM_CHOICE}\"; medians of interleaved repeats.", "",
        "| work | " + " | ".join(names) + " | "
        + " | ".join(f"{name} vs {baseline}" for name in versus) + " |",
        "|---|" + "---:|" * (len(names) + len(versus)),
    ]
    for row in rows:
        seconds = row["seconds"]
        if row["unit"] == "tokens/s":
            cells = [f"{row['tokens'] / seconds[n]:,.0f}" for n in names]
        elif row["unit"] == "s/step":
            cells = [f"{seconds[n]:.2f}" for n in names]
        else:
            cells = [f"{1000 * seconds[n]:.1f}" for n in names]
        speedups = [f"**{seconds[baseline] / seconds[name]:.2f}x**" for name in versus]
        lines.append(f"| {row['work']} ({row['unit']}) | " + " | ".join(cells + speedups) + " |")
    lines += ["", f"Command: `{command}`"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/char_lm.py:small")
    parser.add_argument("--steps", type=int, default=10, help="train steps per timing")
    parser.add_argument("--eval_batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gpt_microbatches", default="1,16",
                        help="train.microbatches values for the 6-layer step ('' skips it)")
    parser.add_argument("--gpt_repeats", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--decode_batches", default="1,8",
                        help="lm_generate batch sizes to time ('' skips decoding)")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS,
                        help="comma-separated, the first is the baseline; of: "
                        + ", ".join(ALL_SETTINGS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    unknown = [name for name in args.settings.split(",") if name not in ALL_SETTINGS]
    if unknown:
        sys.exit(f"--settings: {unknown} unknown; choose from {list(ALL_SETTINGS)}")
    SETTINGS.update({name: ALL_SETTINGS[name] for name in args.settings.split(",")})
    if jax.default_backend() != "cpu":
        sys.exit("xla_options.py compares CPU compile options; this backend is "
                 f"{jax.default_backend()}")
    cpu_memory.keep_freed_memory()  # as the training loop does
    info = hardware.cpu_features()
    print(json.dumps(info), flush=True)
    rows = recipe_steps(args)
    for row in rows:
        print(json.dumps(row), flush=True)
    rows += gpt_train_steps(args)
    rows += decode_loops(args)
    command = "python benchmarks/xla_options.py " + shlex.join(sys.argv[1:])
    text = report(info, rows, command.strip())
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"cpu": info, "settings": SETTINGS, "rows": rows, "command": command.strip()}
    (out / "xla_options.json").write_text(json.dumps(payload, indent=1))
    (out / "xla_options.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
