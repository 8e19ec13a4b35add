"""Time to the first training step: where a run's start goes, phase by phase.

    python benchmarks/startup.py                          # configs/char_lm.py:small, 5 repeats
    python benchmarks/startup.py --config configs/synthetic_seq2seq.py --repeats 3

Each repeat runs fresh Python processes (nothing imported or compiled before):
- the start of `./launch.sh train`, phase by phase: import tfm, `setup` (config, data, mesh),
  the metric writer (tensorboardX), `init_state` (trace, compile, run), compiling the train and
  eval steps;
- the init program, traced and lowered once, then compiled with
  `cpu_compile.run_once_options` (LLVM -O1, what init_state uses) and with the steps'
  options (-O3), in alternating order across repeats; both programs' parameters are compared
  bit for bit;
- the plain `import tensorboardX`, which imports torch when it is installed (tfm imports it
  with torch hidden, `tfm.training.metrics._tensorboardx_writer`: the tensorboardx_writer phase).

Medians over repeats. Writes benchmarks/results/startup.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The start of a training run, in a fresh process: prints one JSON line of phase seconds.
START = r"""
import json, sys, tempfile, time
start = time.perf_counter()
import jax
from tfm.training import experiment, metrics, train
from tfm.parallel import sharding
from configs import CONFIG_MODULE as module
times = {"import": time.perf_counter() - start}

def timed(name, fn):
    begin = time.perf_counter()
    out = fn()
    times[name] = time.perf_counter() - begin
    return out

workdir = tempfile.mkdtemp()
exp = timed("setup", lambda: experiment.setup(module.get_config(ARG), workdir))
timed("tensorboardx_writer", lambda: metrics.MetricWriter(workdir).close())
abstract, shardings = timed("state_shardings", lambda: experiment.state_shardings(exp))
state = timed("init_state", lambda: jax.block_until_ready(experiment.init_state(exp, shardings)))
jit_train, jit_eval = train.jit_steps(exp, shardings)
batch_sharding = sharding.batch_sharding(exp.mesh, exp.rules)
batch = sharding.shard_batch(next(exp.data.train_iterator()), exp.mesh, batch_sharding, exp.rules)
eval_batch = sharding.shard_batch(dict(next(iter(exp.data.eval_batches(exp.eval_splits[0])))),
                                  exp.mesh, batch_sharding, exp.rules)
timed("train_step_compile", lambda: jit_train.lower(state, batch).compile())
timed("eval_step_compile", lambda: jit_eval.lower(state.params, eval_batch).compile())
times["total"] = time.perf_counter() - start
print(json.dumps({"times": times, "torch_loaded": "torch" in sys.modules}))
"""

# The init program compiled both ways from one lowering, in the order ORDER.
INIT_COMPILE = r"""
import json, sys, tempfile, time
import jax
from flax import linen as nn
from tfm.kernels import hardware, cpu_compile
from tfm.training import experiment, state
from tfm.parallel import sharding
from configs import CONFIG_MODULE as module
exp = experiment.setup(module.get_config(ARG), tempfile.mkdtemp())
abstract, shardings = experiment.state_shardings(exp)
init = state._init_fn(exp)
rng = jax.random.PRNGKey(exp.train.seed)
options = {"run_once": cpu_compile.run_once_options(),
           "steps": cpu_compile.compiler_options()}
with sharding.sharding_context(exp.mesh, exp.rules):
    lowered = jax.jit(lambda key: nn.meta.unbox(init(key)), out_shardings=shardings).lower(rng)
    seconds, states = {}, {}
    for name in ORDER:
        begin = time.perf_counter()
        compiled = lowered.compile(compiler_options=options[name])
        seconds[name] = time.perf_counter() - begin
        states[name] = jax.block_until_ready(compiled(rng))
same = all((a == b).all() for a, b in zip(jax.tree.leaves(states["run_once"]),
                                          jax.tree.leaves(states["steps"])))
print(json.dumps({"seconds": seconds, "bit_identical": bool(same), "options": options}))
"""

PLAIN_TENSORBOARDX = r"""
import json, sys, time
start = time.perf_counter()
import tensorboardX
print(json.dumps({"seconds": time.perf_counter() - start, "torch_loaded": "torch" in sys.modules}))
"""


def run_child(code: str) -> dict:
    # cwd=ROOT: `python -c` puts the working directory first on sys.path, so `configs` imports
    # from the checkout while tfm comes from the installed package.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"child process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/char_lm.py:small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()


    path, _, arg = args.config.partition(":")

    def child_code(template: str, order: list[str] | None = None) -> str:
        return (template.replace("CONFIG_MODULE", Path(path).stem)
                .replace("ARG", repr(arg or None)).replace("ORDER", repr(order)))

    starts, init_compiles, plain = [], [], []
    for repeat in range(args.repeats):
        starts.append(run_child(child_code(START)))
        order = ["run_once", "steps"] if repeat % 2 == 0 else ["steps", "run_once"]
        init_compiles.append(run_child(child_code(INIT_COMPILE, order)))
        plain.append(run_child(PLAIN_TENSORBOARDX))
        print(f"repeat {repeat + 1}/{args.repeats}: start {starts[-1]['times']['total']:.1f} s, "
              f"init compile {init_compiles[-1]['seconds']}", flush=True)

    phases = {name: statistics.median([run["times"][name] for run in starts])
              for name in starts[0]["times"]}
    init_compile = {name: statistics.median([run["seconds"][name] for run in init_compiles])
                    for name in ("run_once", "steps")}
    plain_seconds = statistics.median([p["seconds"] for p in plain])
    import jax

    from tfm.kernels import hardware

    cpu = hardware.cpu_features()

    lines = [
        f"# Time to the first training step, {args.config}",
        "",
        f"{hardware.cpu_line(cpu)}; jax {jax.__version__}. Medians of {args.repeats} "
        "fresh processes.",
        "",
        "| phase | seconds |",
        "|---|---:|",
        *[f"| {name} | {seconds:.2f} |" for name, seconds in phases.items()],
        "",
        f"Compiling the init program (one lowering, both orders): "
        f"{init_compile['run_once']:.2f} s with run_once_options "
        f"({init_compiles[0]['options']['run_once']}), {init_compile['steps']:.2f} s with the "
        f"steps' options ({init_compiles[0]['options']['steps']}); parameters bit-identical in "
        f"every repeat: {all(run['bit_identical'] for run in init_compiles)}.",
        f"tensorboardX: {phases['tensorboardx_writer']:.2f} s for tfm's writer, torch hidden "
        f"(torch loaded after the start: {any(run['torch_loaded'] for run in starts)}); plain "
        f"`import tensorboardX` {plain_seconds:.2f} s (torch loaded: "
        f"{plain[0]['torch_loaded']}).",
        "",
        f"Command: `python benchmarks/startup.py {shlex.join(sys.argv[1:])}`",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps(
        {"cpu": cpu, "config": args.config, "phases_median_s": phases,
         "init_compile_median_s": init_compile, "plain_tensorboardx_import_s": plain_seconds,
         "starts": starts, "init_compiles": init_compiles, "plain": plain}, indent=1))
    (out / "startup.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
