"""./launch.sh (and tfm/main.py behind it): usage errors, and train -> generate -> average ->
eval end to end on a tiny configs/synthetic_lm.py model, each command a fresh process as a user
would run it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

from tfm.training import checkpoint, metrics

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch.sh"


def launch(*args: str, cwd: Path | None = None, env: dict | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCH), *args], cwd=cwd or REPO, env={**os.environ, **(env or {})},
        capture_output=True, text=True, timeout=timeout,
    )


# ------------------------------------------------------------------- usage errors (bash only)


def test_no_arguments_prints_usage():
    result = launch()
    assert result.returncode == 2
    assert "expected a COMMAND and a CONFIG" in result.stderr
    assert "usage: ./launch.sh COMMAND [CONFIG[:ARG]]" in result.stderr


@pytest.mark.parametrize("args", [("--help",), ("-h",)])
def test_help_exits_zero(args):
    result = launch(*args)
    assert result.returncode == 0
    assert "usage: ./launch.sh" in result.stdout
    for command in ("train", "eval", "generate", "average"):
        assert f"\n  {command} " in result.stdout
    assert "--workdir DIR to continue a run under other settings" in result.stdout
    assert "workdirs/char_lm_runlocal+position_scheme=alibi" in result.stdout


@pytest.mark.parametrize("command", ["train", "eval", "generate", "average", "compile"])
def test_each_command_has_its_own_help(command):
    """`COMMAND --help`: that command's usage and options, not the global list."""
    result = launch(command, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: ./launch.sh {command} ")
    others = {"train", "eval", "generate", "average", "compile"} - {command}
    assert not any(f"usage: ./launch.sh {other}" in result.stdout for other in others)
    assert "\ncommands:" not in result.stdout
    if command == "compile":
        from tfm.training.compile_report import TARGETS

        targets = next(line for line in result.stdout.splitlines() if line.startswith("targets:"))
        assert targets == "targets: " + ", ".join(TARGETS)
        assert "h100-8" in targets and "a100-8" in targets
    if command == "train":
        assert "--workdir DIR to continue a run under other settings" in result.stdout
    if command in ("eval", "generate", "average"):
        assert "DIR/config.json" in result.stdout


def test_train_config_help_lists_fields_with_values_and_docs():
    result = launch("train", "configs/char_lm.py:runlocal", "--config.model.d_model=96", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("usage: ./launch.sh train ")
    for section in ("model:", "data:", "optimizer:", "train:", "eval:", "generate:"):
        assert section in lines
    d_model = next(line for line in lines if line.startswith("  d_model = "))
    assert d_model.split()[:3] == ["d_model", "=", "96"]  # the override applied
    assert "width of every residual stream" in d_model
    max_len = next(line for line in lines if line.startswith("  max_len = "))
    assert "only bounds `learned` positions" in max_len  # the field's comment in ModelConfig
    kind = next(line for line in lines if line.startswith("  kind = 'text'"))
    assert '"synthetic" | "text" | "parallel" | "tfds"' in kind  # data's docstring field list
    grad_clip = next(line for line in lines if line.startswith("  grad_clip_norm = "))
    assert "0 = no clipping" in grad_clip  # optim.DEFAULTS' comment


def test_report_help_is_not_cut_mid_sentence():
    result = launch("report", "--help")
    assert result.returncode == 0
    assert "or folder of runs." in " ".join(result.stdout.split())


@pytest.mark.parametrize("args", [
    ("generate", "configs/char_lm.py", "--prompt_ids", "5 6 7"),
    ("train", "configs/synthetic_lm.py", "--no_such_flag"),
    ("eval", "configs/synthetic_lm.py", "--step=x"),
])
def test_usage_error_is_one_line_and_a_pointer_to_help(args):
    result = launch(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[1] == f"see ./launch.sh {args[0]} --help"


def test_prompt_ids_with_a_value_names_the_switch():
    result = launch("generate", "configs/char_lm.py", "--prompt_ids", "5 6 7")
    assert result.stderr.splitlines()[0] == (
        "tfm.main generate: --prompt_ids is a switch and takes no value (--prompt_ids or "
        "--noprompt_ids); got '5 6 7' after it")


# ------------------------------------------------------------------ default workdir names


@pytest.mark.parametrize("overrides, expected", [
    ([], "char_lm_runlocal"),
    ([("model.position_scheme", "alibi")], "char_lm_runlocal+position_scheme=alibi"),
    ([("data.path", "/x/my_corpus.txt"), ("train.num_steps", "500")],
     "char_lm_runlocal+path=my_corpus+num_steps=500"),
    # what does not change what is trained stays out of the name
    ([("generate.max_new_tokens", "40"), ("eval.splits", "('test',)"),
      ("train.progress_bar", "false"), ("train.log_every", "5"), ("model.d_model", "96")],
     "char_lm_runlocal+d_model=96"),
    # two fields with one last name: their dotted paths
    ([("train.seed", "1"), ("model.d_ff", "64"), ("data.seed", "2")],
     "char_lm_runlocal+train.seed=1+d_ff=64+data.seed=2"),
    ([("data.train_lengths", "(1, 8)")], "char_lm_runlocal+train_lengths=1_8"),
])
def test_default_workdir_names_the_overrides(overrides, expected):
    from tfm import main

    assert main.default_workdir("configs/char_lm.py:runlocal", overrides) == Path(
        "workdirs", expected)


def test_default_workdir_of_many_overrides_is_cut_with_a_hash():
    from tfm import main

    many = [(f"model.field_{i}", "x" * 20) for i in range(8)]
    name = main.default_workdir("configs/char_lm.py:runlocal", many).name
    other = main.default_workdir("configs/char_lm.py:runlocal", [*many[:-1], ("model.f", "y")])
    assert len(name) == 100 and re.fullmatch(r".*-[0-9a-f]{8}", name)
    assert name != other.name and name[:90] == other.name[:90]


def test_config_overrides_reads_both_flag_forms_in_order():
    from tfm import main

    argv = ["tfm.main", "train", "--config=configs/x.py", "--config.model.d_model=64",
            "--config.train.seed", "3", "--config.train.progress_bar", "--workdir=w"]
    assert main.config_overrides(argv) == [
        ("model.d_model", "64"), ("train.seed", "3"), ("train.progress_bar", "true")]


def test_train_prints_its_default_workdir_first(tmp_path):
    """The workdir is the first line of train (here a config that fails at once)."""
    config = tiny_config(tmp_path)
    result = launch("train", str(config), "--config.model.num_heads=3", cwd=tmp_path)
    assert result.stdout.splitlines()[0] == "workdir: workdirs/tiny+num_heads=3"


# ---------------------------------------------------------------- commands on a run's config


def test_saved_config_reads_config_json_as_an_overridable_config(tmp_path):
    from tfm import saved_config

    (tmp_path / "config.json").write_text(json.dumps({
        "model": {"d_model": 32, "attention_backend": "splash", "head_dim": None},
        "data": {"kind": "text", "path": "x.txt", "train_lengths": [1, 6],
                 "features": None},
        "logical_axis_rules": [["embed", None]],
        "vocabulary": {"size": 65},  # what a newer run may save besides the config
    }))
    config = saved_config.get_config(str(tmp_path))
    assert sorted(config) == ["data", "logical_axis_rules", "model"]
    assert config.data.train_lengths == (1, 6) and config.logical_axis_rules == (("embed", None),)
    assert config.model.attention_backend == "auto"  # resolved per platform again
    config.model.head_dim = 8  # a None field stays overridable
    with pytest.raises(saved_config.NoSavedConfig, match="has no config.json"):
        saved_config.get_config(str(tmp_path / "none"))


def test_commands_on_a_run_take_its_saved_config(tmp_path, monkeypatch, capsys):
    """eval/generate/average: the workdir's config.json replaces CONFIG (given or not), the
    --config overrides stay; the default workdir is CONFIG's."""
    from tfm import main

    monkeypatch.chdir(tmp_path)
    run = Path("workdirs/tiny+num_steps=24")
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    argv = ["tfm.main", "generate", "--config=configs/tiny.py", "--config.train.num_steps=24",
            "--config.generate.max_new_tokens=4", "--prompt=12"]
    assert main.with_saved_config(argv) == [  # --config= before the overrides of its fields
        "tfm.main", "generate", f"--config={main.SAVED_CONFIG}:{run}", f"--workdir={run}",
        "--config.train.num_steps=24", "--config.generate.max_new_tokens=4", "--prompt=12"]
    assert "using the run's saved config workdirs/tiny+num_steps=24/config.json" in (
        capsys.readouterr().err)
    without = ["tfm.main", "eval", "--workdir", str(run)]
    assert main.with_saved_config(without) == [
        "tfm.main", "eval", f"--config={main.SAVED_CONFIG}:{run}", f"--workdir={run}"]
    old_run = ["tfm.main", "eval", "--config=configs/tiny.py", "--workdir=elsewhere"]
    assert main.with_saved_config(old_run) == old_run  # no config.json: CONFIG as given


def test_command_on_a_workdir_without_a_run_is_one_line(tmp_path):
    result = launch("generate", "--workdir", str(tmp_path / "none"), "--prompt", "12")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"tfm.main generate: {tmp_path / 'none'} has no config.json: no training run there; "
        "train one, or give the run's CONFIG"]


# ------------------------------------------------------------------------------- compile


def test_no_tpu_startup_noise_on_a_host_without_tpus(monkeypatch):
    from tfm import main

    for name in ("TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("glob.glob", lambda pattern: [])  # no Google PCI device
    main.no_tpu_startup_noise()
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"
    assert os.environ["TPU_HOST_BOUNDS"] == "1,1,1"


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu ([tpu])")
def test_compile_for_a_tpu_prints_no_libtpu_startup_errors(tmp_path):
    result = launch("compile", str(tiny_config(tmp_path)), "--target", "v5e-8",
                    "--workdir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TPU_WORKER_HOSTNAMES" not in result.stderr and "E0000" not in result.stderr
    assert "target v5e-8" in result.stdout


def test_unknown_command_is_named():
    result = launch("fit", "configs/char_lm.py")
    assert result.returncode == 2
    assert "unknown command 'fit'" in result.stderr
    assert "train, eval, generate, average" in result.stderr


def test_missing_config_file_is_named(tmp_path):
    result = launch("train", "configs/no_such_config.py:runlocal")
    assert result.returncode == 2
    assert "config file 'configs/no_such_config.py' not found" in result.stderr
    elsewhere = launch("train", "configs/no_such_config.py", cwd=tmp_path)
    assert elsewhere.returncode == 2 and "no_such_config.py" in elsewhere.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("--workdir",), "--workdir needs a value"),
        (("--num_processes=0",), "got '0'"),
        (("--devices_per_process", "two"), "got 'two'"),
    ],
)
def test_bad_launcher_options(args, message):
    result = launch("train", "configs/synthetic_lm.py", *args)
    assert result.returncode == 2
    assert message in result.stderr


# ------------------------------------------------------- flag errors (python: loads the config)


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.foo=1", "--config.foo: the config has no field 'foo'"),
    ],
)
def test_unknown_override_is_one_clean_line(override, message, tmp_path):
    # Called from another directory: CONFIG is still found relative to the repository root.
    result = launch("train", "configs/synthetic_lm.py", override, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 2  # the error and a usage hint


@pytest.mark.parametrize(
    "path, expected",
    [
        ("model.d_modle", "--config.model.d_modle: the config has no field 'd_modle'; "
                          'Did you mean "d_model" instead of "d_modle"?'),
        ("modle.d_model", "--config.modle.d_model: the config has no field 'modle'"),
        ("model.d_model.x", "--config.model.d_model.x: Attribute"),
    ],
)
def test_override_error_line(path, expected):
    """The one line tfm.main prints for ml_collections' own exceptions (in process)."""
    from ml_collections import config_dict
    from ml_collections.config_flags import config_path

    from tfm import main

    config = config_dict.ConfigDict({"model": {"d_model": 32}})
    with pytest.raises((KeyError, AttributeError)) as error:
        config_path.get_type(path, config)
    argv = ["tfm.main", "train", "--config=x.py", "--config.train.num_steps=3",
            f"--config.{path}=1"]
    assert main._flag_error_line(error.value, argv).startswith(expected)


def test_bad_config_value_is_one_clean_line():
    """Errors in values (found by tfm.training.experiment.parse_config before any data is read)
    print
    one line naming the field and exit 1."""
    result = launch("train", "configs/synthetic_lm.py", "--config.model.num_heads=3")
    assert result.returncode == 1
    assert "ConfigError: model.d_model=64 is not divisible by num_heads=3" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_variant_is_one_clean_line():
    result = launch("train", "configs/synthetic_lm.py:rotary")
    assert result.returncode == 2
    assert "config variant 'rotary' is unknown; choose from:" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------- end to end

TINY_CONFIG = """
from configs import synthetic_lm


def get_config(arg=None):
    config = synthetic_lm.get_config("copy,runlocal")
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=1)
    config.data.update(data_dir={data_dir!r}, batch_size=16, seq_len=16, train_lengths=(1, 6),
                       eval_lengths=(7, 8), num_train_examples=512, num_eval_examples=16)
    config.optimizer.update(total_steps=24, warmup_steps=4)
    config.train.update(num_steps=30, log_every=4, eval_every=0, checkpoint_every=8,
                        max_to_keep=3, keep_best_metric=None, progress_bar=False)
    config.eval.update(splits=("validation",), max_generation_examples=8)
    config.generate.max_new_tokens = 8
    return config
"""


def test_synthetic_lm_train_generate_average_eval(tmp_path):
    """The synthetic_lm family learns (loss falls) when trained through ./launch.sh; then
    generate, average (the mean of the last 2 checkpoints) and eval of the average."""
    config = tmp_path / "tiny.py"
    config.write_text(TINY_CONFIG.format(data_dir=str(tmp_path / "data")))
    workdir, averaged = tmp_path / "run", tmp_path / "averaged"
    # Later processes load what earlier ones compiled (the eval step, here).
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}

    trained = launch("train", str(config), "--workdir", str(workdir),
                     "--config.train.num_steps=24", env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert trained.stdout.splitlines()[0] == f"workdir: {workdir}"
    if len(os.sched_getaffinity(0)) > 1:  # the hint names a train flag: train only
        assert "training on 1 CPU device" in trained.stderr
    final = json.loads(trained.stdout[trained.stdout.index("{"):])
    assert final["step"] == 24 and final["workdir"] == str(workdir)  # the override applied
    losses = [r["train_loss"] for r in metrics.read_metrics(workdir) if "train_loss" in r]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < 0.8 * np.mean(losses[:2]), losses
    assert 0 <= final["eval_exact_match"] <= 100 and np.isfinite(final["eval_loss"])
    with checkpoint.Checkpointer(workdir / "checkpoints") as checkpointer:
        assert checkpointer.all_steps() == [8, 16, 24]

    # No CONFIG: the run's config.json (with the override num_steps=24 in it), and a --config
    # flag over it.
    generated = launch("generate", "--workdir", str(workdir), "--config.generate.max_new_tokens=2",
                       "--prompt", "123", "--prompt", "4051", env=env)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert f"using the run's saved config {workdir / 'config.json'}" in generated.stderr
    assert "training on 1 CPU device" not in generated.stderr
    lines = generated.stdout.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["123", "4051"]
    assert all(line.split("\t")[1] == "->" for line in lines)
    outputs = [line.split("\t")[2] if line.count("\t") == 2 else "" for line in lines]
    assert all(len(output) <= 2 for output in outputs), lines  # the override applied

    average = launch("average", str(config), "--workdir", str(workdir), "--last_k", "2",
                     "--output", str(averaged), env=env)
    assert average.returncode == 0, average.stderr[-3000:]
    assert "(step 24)" in average.stdout
    with checkpoint.Checkpointer(workdir / "checkpoints") as source:
        params = [source.restore(step)["params"] for step in (16, 24)]
    with checkpoint.Checkpointer(averaged / "checkpoints") as target:
        assert target.all_steps() == [24]
        mean = target.restore(24)["params"]
        assert target.saved_config(24)["averaged_steps"] == [16, 24]
    expected = jax.tree.map(lambda a, b: (np.asarray(a) + np.asarray(b)) / 2, *params)
    assert jax.tree.structure(mean) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(mean), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)

    evaluated = launch("eval", "--workdir", str(averaged), env=env)  # average copied config.json
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "training on 1 CPU device" not in evaluated.stderr
    results = json.loads(evaluated.stdout[evaluated.stdout.index("{"):])
    assert results["step"] == 24
    assert np.isfinite(results["eval_loss"]) and 0 <= results["eval_exact_match"] <= 100


# ------------------------------------------------------------- failures a user meets: one line


def tiny_config(tmp_path) -> Path:
    config = tmp_path / "tiny.py"
    config.write_text(TINY_CONFIG.format(data_dir=str(tmp_path / "data")))
    return config


def test_generate_with_empty_stdin_is_one_line(tmp_path):
    result = subprocess.run(
        ["bash", str(LAUNCH), "generate", "configs/synthetic_lm.py", "--workdir",
         str(tmp_path / "run")], cwd=REPO, input="\n  \n", capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tfm.main generate: no prompt: give --prompt TEXT (repeatable) or non-empty lines on "
        "stdin"]


def test_unwritable_workdir_is_one_line_naming_path_and_operation(tmp_path):
    """An OSError (here: the workdir's parent is a file) names the operation and the path."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = launch("train", str(tiny_config(tmp_path)), "--workdir", str(blocker / "run"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"tfm.main train: NotADirectoryError: cannot mkdir {blocker / 'run'}: Not a directory")
    assert "Traceback" not in result.stderr


def test_os_error_line_names_operation_path_and_reason():
    import errno

    from tfm import main

    def write_text():  # stands for pathlib's: the innermost frame names the operation
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/metrics.jsonl")

    def rename():
        raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), "/ro/a", None, "/ro/b")

    for function, expected in [
        (write_text, "OSError: cannot write_text /runs/x/metrics.jsonl: No space left on device"),
        (rename, "PermissionError: cannot rename /ro/a -> /ro/b: Read-only file system"),
    ]:
        with pytest.raises(OSError) as error:
            function()
        assert main.os_error_line(error.value) == expected


def test_prompt_errors_are_one_line(tmp_path):
    """Characters outside the vocabulary (the space of the old --help example) and a prompt past
    a learned position table: one line each, before any checkpoint is read or compiled."""
    config = str(tiny_config(tmp_path))
    result = launch("generate", config, "--workdir", str(tmp_path / "none"),
                    "--prompt", "3 1 4 1 5")
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "tfm.main generate: PromptError: prompt 1 '3 1 4 1 5' has characters outside the "
        "vocabulary: ' ' (the vocabulary: ")
    learned = launch("generate", config, "--workdir", str(tmp_path / "none"),
                     "--config.model.position_scheme=learned", "--config.model.max_len=30",
                     "--prompt", "0123456789" * 3)
    assert learned.returncode == 1, learned.stderr[-2000:]
    assert learned.stderr.strip().splitlines()[-1] == (
        "tfm.main generate: PromptError: prompt 1 '012345678901234567890123456789' is 32 "
        "tokens; its prompt and output needs 40 positions, past model.max_len=30 of the learned "
        "position table; shorten the prompt or lower generate.max_new_tokens")
    assert "Traceback" not in result.stderr + learned.stderr


def test_help_example_prompt_is_in_the_quick_start_vocabulary():
    usage = launch("--help").stdout
    prompts = [line.split("--prompt ")[1].strip().strip('"') for line in usage.splitlines()
               if "synthetic_seq2seq.py --prompt" in line]
    assert prompts and all(set(p) <= set("0123456789") for p in prompts), prompts


def test_train_stopped_by_a_signal_exits_128_plus_signum(monkeypatch, tmp_path, capsys):
    """A run that saved and stopped on SIGTERM is not a finished run: the exit status says so
    (a sweep or a scheduler then resumes it instead of recording it done)."""
    from tfm import main
    from tfm.training import train

    monkeypatch.setattr(train, "train_and_evaluate",
                        lambda config, workdir: {"step": 7, "stopped_by": "SIGTERM"})
    with pytest.raises(SystemExit) as stopped:
        main._run("train", None, tmp_path, "configs/x.py")
    assert stopped.value.code == 143
    assert '"stopped_by": "SIGTERM"' in capsys.readouterr().out
    monkeypatch.setattr(train, "train_and_evaluate", lambda config, workdir: {"step": 9})
    main._run("train", None, tmp_path, "configs/x.py")  # finished: returns normally
