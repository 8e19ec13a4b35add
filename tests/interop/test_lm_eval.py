"""tfm in EleutherAI's lm-evaluation-harness (tfm/interop/lm_eval/): the adapter's numbers
against tfm's own forward pass computed here (float32, 1e-5), the harness's evaluator on the
local tasks of tests/fixtures/lm_eval/ (multiple choice, rolling perplexity, generate_until),
offline, on a one-step char LM; two processes against one; and, where torch is installed, the
harness's own `hf` model against `tfm` on a GPT-2 exported by tfm."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip(
    "lm_eval", reason='lm-eval is not installed (pip install -e ".[eval]")'
)

import jax  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from configs import char_lm  # noqa: E402
from tfm.interop import lm_eval as adapter  # noqa: E402
from tfm.nn.models import DecoderLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "lm_eval"
TASKS = ["tfm_tiny_choice", "tfm_tiny_rolling", "tfm_tiny_generate"]
SEQ_LEN = 32  # the run's training rows: the adapter's max_length
CORPUS = (
    "Now is the winter of our discontent made glorious summer by this sun of York.\n\n"
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n\n"
    "ROMEO:\nWhat light through yonder window breaks? It is the east, and Juliet is the sun.\n\n"
    "JULIET:\nGood night, good night! Parting is such sweet sorrow.\n\n"
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A one-step char LM (rope, 1 layer, d_model 16) trained on rows of 32 characters."""
    from tfm.training import train

    root = tmp_path_factory.mktemp("lm_eval")
    corpus = root / "corpus.txt"
    corpus.write_text(CORPUS * 8)
    config = char_lm.get_config("runlocal")
    config.model.update(d_model=16, num_heads=2, d_ff=32, num_decoder_layers=1, max_len=64,
                        dropout_rate=0.0)
    config.data.update(path=str(corpus), seq_len=SEQ_LEN, eval_seq_len=SEQ_LEN, batch_size=8,
                       eval_batch_size=8, data_dir=str(root / "data"))
    config.optimizer.update(warmup_steps=0, learning_rate=1e-2)
    config.train.update(num_steps=1, log_every=1, eval_every=0, checkpoint_every=1,
                        progress_bar=False, keep_best_metric=None)
    config.eval.max_batches = 1
    train.train_and_evaluate(config, root / "run")
    return root / "run"


@pytest.fixture(scope="module")
def model(run_dir) -> adapter.TfmLM:
    return adapter.TfmLM(workdir=str(run_dir), batch_size=4)  # several batches, filler rows


@functools.cache
def _forward(config):
    return jax.jit(lambda params, tokens: DecoderLM(config).apply({"params": params}, tokens))


def log_probs(model: adapter.TfmLM, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab] float64 log-probabilities of tfm's forward pass on one row. The row is
    followed by other tokens up to a fixed width (one compilation) with no mask: a causal
    model's logits at position t depend only on tokens up to t."""
    tokens = np.full((1, 2 * SEQ_LEN), model.prefix_token_id, np.int32)
    tokens[0, :len(ids)] = ids
    logits = np.asarray(_forward(model.config)(model.params, tokens)[0, :len(ids)], np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                           keepdims=True)) - logits.max(-1, keepdims=True)


def expected_loglikelihood(model, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of log p of the continuation's characters, and whether each is the argmax, from one
    forward pass on [bos] + context + continuation (one id per character)."""
    ids = model.tok_encode(context + continuation)
    start = len(model.tok_encode(context))
    row = log_probs(model, ids[:-1])
    positions = range(start - 1, len(ids) - 1)
    total = sum(row[t, ids[t + 1]] for t in positions)
    greedy = all(row[t].argmax() == ids[t + 1] for t in positions)
    return float(total), bool(greedy)


def close(want: float, num_tokens: int):
    """float32 log-likelihood sums agree to 1e-5 per summed token."""
    return pytest.approx(want, abs=1e-5 * num_tokens)


def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, args, index) for index, args in enumerate(arguments)]


def test_loglikelihood_equals_the_forward_pass(model):
    pairs = [("ROMEO", ":"), ("To be, or not", " to be"), ("Now is the winter of our", " disco"),
             ("Good night", ", good night!"), ("a", "b"), ("What light", " through yonder")]
    results = model.loglikelihood(requests("loglikelihood", pairs))
    for (context, continuation), (total, greedy) in zip(pairs, results, strict=True):
        want, want_greedy = expected_loglikelihood(model, context, continuation)
        assert total == close(want, len(continuation)), (context, continuation)
        assert greedy == want_greedy


def test_greedy_continuation_is_greedy(model):
    """The argmax character after a context, computed here, is_greedy; another is not."""
    context = "JULIET"
    ids = model.tok_encode(context)
    best = int(log_probs(model, ids)[-1].argmax())
    other = (best + 1 - model.tokenizer.offset) % len(model.tokenizer.chars)
    best_text = model.tokenizer.decode([best])
    other_text = model.tokenizer.chars[other]
    [(_, is_best), (_, is_other)] = model.loglikelihood(
        requests("loglikelihood", [(context, best_text), (context, other_text)]))
    assert is_best and not is_other


def test_an_empty_context_conditions_on_the_prefix_token(model):
    [(total, _)] = model.loglikelihood(requests("loglikelihood", [("", "Now")]))
    ids = model.tok_encode("Now")  # [bos, N, o, w]
    row = log_probs(model, ids[:-1])
    assert total == close(sum(row[t, ids[t + 1]] for t in range(3)), 3)


def test_a_long_context_keeps_the_last_max_length_tokens(model):
    context, continuation = "Now is the winter of our discontent made glorious", " summer"
    [(total, _)] = model.loglikelihood(requests("loglikelihood", [(context, continuation)]))
    ids = model.tok_encode(context + continuation)[-(SEQ_LEN + 1):]
    row = log_probs(model, ids[:-1])
    scored = range(SEQ_LEN - len(continuation), SEQ_LEN)
    assert total == close(sum(row[t, ids[t + 1]] for t in scored), len(continuation))


def test_rolling_loglikelihood_of_a_document_in_one_window(model):
    text = "What light through yonder"  # 25 characters < 32
    [total] = model.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    ids = [model.prefix_token_id, *model.tokenizer.encode(text)]
    row = log_probs(model, ids[:-1])
    assert total == close(sum(row[t, ids[t + 1]] for t in range(len(text))), len(text))


def test_rolling_windows_of_a_document_longer_than_the_model(model):
    text = CORPUS[:90]
    ids = model.tokenizer.encode(text)
    windows = adapter.rolling_windows(ids, model.prefix_token_id, SEQ_LEN)
    assert len(windows) == 3  # 32 + 32 + 26 predicted tokens
    assert [t for _, continuation in windows for t in continuation] == ids  # each token once
    assert windows[0][0] == [model.prefix_token_id]
    for context, continuation in windows:  # as much context as fits max_length
        assert len(context) + len(continuation) - 1 == SEQ_LEN
    want = 0.0
    for context, continuation in windows:
        row_ids = [*context, *continuation]
        row = log_probs(model, row_ids[:-1])
        want += sum(row[t, row_ids[t + 1]] for t in range(len(context) - 1, len(row_ids) - 1))
    [total] = model.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert total == close(want, len(ids))


def test_generate_until_is_greedy_decoding_cut_at_the_stop_string(model):
    prompts = ["ROMEO:\n", "To be", "JULIET:\nGood night"]
    outputs = model.generate_until(requests("generate_until", [
        (prompt, {"until": ["e"], "max_gen_toks": 6}) for prompt in prompts]))
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = model.tok_encode(prompt)
        new = []
        for _ in range(6):  # greedy by full forward passes, no cache
            token = int(log_probs(model, ids + new)[-1].argmax())
            if token == model.eot_token_id:
                break
            new.append(token)
        assert output == adapter.cut_at_stop(model.tokenizer.decode(new), ["e"])
        assert "e" not in output


@pytest.fixture(scope="module")
def harness_results(model) -> dict:
    """The harness's evaluator on the fixture tasks, on one process."""
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)  # the task files name their data relative to the repository
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        return lm_eval.simple_evaluate(
            model=model, tasks=TASKS, task_manager=TaskManager(include_path=str(FIXTURES)),
        )["results"]


def test_the_harness_evaluates_local_tasks(model, harness_results):
    """simple_evaluate on the fixture tasks; bits_per_byte is the adapter's rolling
    log-likelihoods over the documents' UTF-8 bytes."""
    import json

    results = harness_results
    assert 0.0 <= results["tfm_tiny_choice"]["acc,none"] <= 1.0
    assert 0.0 <= results["tfm_tiny_generate"]["exact_match,none"] <= 1.0
    texts = [json.loads(line)["text"] for line in open(FIXTURES / "rolling.jsonl")]
    totals = model.loglikelihood_rolling(
        requests("loglikelihood_rolling", [(text,) for text in texts]))
    num_bytes = sum(len(text.encode("utf-8")) for text in texts)
    assert results["tfm_tiny_rolling"]["bits_per_byte,none"] == pytest.approx(
        -sum(totals) / num_bytes / math.log(2), rel=1e-6)


def test_helpers():
    assert adapter.cut_at_stop("abc.def\nx", ["\n", "."]) == "abc"
    assert adapter.cut_at_stop("abc", ["", "z"]) == "abc"
    assert [adapter.bucket_width(n, 32) for n in (1, 8, 9, 17, 32, 40)] == [8, 8, 16, 32, 32, 40]
    assert adapter.length_batches([3, 9, 5, 9], 3) == [[1, 3, 2], [0]]
    row = adapter.scoring_row([1, 5, 6], [7, 8], max_length=3)  # keeps the last 4 tokens
    assert row == adapter.ScoringRow((5, 6, 7), (6, 7, 8), 2)
    with pytest.raises(ValueError, match="does not fit max_length=3"):
        adapter.scoring_row([1], [2, 3, 4, 5], max_length=3)


def test_model_args_are_checked():
    with pytest.raises(ValueError, match="give one of workdir=DIR"):
        adapter.TfmLM()
    with pytest.raises(ValueError, match="unknown to tfm"):
        adapter.TfmLM(workdir="x", temperature=1)


def test_registered_as_tfm():
    from lm_eval.api.registry import get_model

    assert get_model("tfm") is adapter.TfmLM
    # The harness imports its own models only while its registry is empty: registering tfm
    # must not hide them.
    assert {"hf", "vllm", "dummy"} <= set(lm_eval.api.registry.model_registry.keys())


def test_a_hugging_face_folder_scores_as_transformers_does():
    """pretrained=DIR (the committed tiny GPT-2 folder, whose reference.npz holds transformers'
    own logits for two rows): the log-likelihood of each row's last tokens given its first is
    what the harness's `hf` model computes from those logits (log-softmax at the positions
    before each continuation token), and is_greedy is their argmax; 1e-4 as for imports."""
    folder = REPO / "tests" / "fixtures" / "hf" / "gpt2"
    reference = np.load(folder / "reference.npz")
    model = adapter.TfmLM(pretrained=str(folder), batch_size=2)
    assert model.max_length == 16  # n_positions
    pairs, expected = [], []
    for row, logits in zip(reference["input_ids"], reference["logits"], strict=True):
        for split in (1, 3, 5):
            context, continuation = [int(t) for t in row[:split]], [int(t) for t in row[split:]]
            shifted = np.asarray(logits[split - 1:-1], np.float64)  # predicts row[split:]
            log_softmax = shifted - np.log(np.exp(shifted - shifted.max(-1, keepdims=True)).sum(
                -1, keepdims=True)) - shifted.max(-1, keepdims=True)
            picked = log_softmax[np.arange(len(continuation)), continuation]
            pairs.append((context, continuation))
            expected.append((picked.sum(), bool((shifted.argmax(-1) == continuation).all())))
    got = model.score(pairs)
    for (total, greedy), (want, want_greedy) in zip(got, expected, strict=True):
        assert total == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy


# Each process of a 2-process run on localhost (one CPU device each, the run's data axis across
# them): evaluate() on the fixture tasks, then loglikelihood and generate_until requests on
# process 0 while process 1 follows. argv: process id, run dir, output dir.
WORKER = """
import json, sys
import jax
from tfm.interop import lm_eval as adapter
from lm_eval.api.instance import Instance
process_id, run_dir, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
model = adapter.TfmLM(workdir=run_dir, batch_size=4)  # starts jax.distributed (TFM_*)
assert model.shared and jax.process_count() == 2 and model.batch_size == 4
adapter.evaluate(model, {tasks}, out_dir, include_path="tests/fixtures/lm_eval")
if process_id == 0:
    try:
        pairs = model.loglikelihood([Instance("loglikelihood", {{}}, pair, index)
                                     for index, pair in enumerate({pairs})])
        texts = model.generate_until([Instance("generate_until", {{}}, (prompt, {generation}),
                                               index) for index, prompt in enumerate({prompts})])
    finally:
        model.release_followers()
    json.dump({{"pairs": pairs, "texts": texts}}, open(out_dir + "/requests.json", "w"))
else:
    model.follow()
"""
# One batch of 4 rows 32 wide, and generation as the fixture task's: the shapes the harness's
# tasks compiled already (each new shape compiles in both processes).
PAIRS = [("ROMEO", ":"), ("To be, or not", " to be"), ("a", "b"), ("Good night", ", good night!")]
PROMPTS = ["ROMEO:\n", "To be", "JULIET:\n"]
GENERATION = {"until": ["\n", "."], "max_gen_toks": 8}


def test_two_processes_give_process_0_the_one_process_results(run_dir, model, harness_results,
                                                             tmp_path):
    """Levanter's scheme: process 0 runs the harness and broadcasts each batch; the batch is
    split over the data axis across both processes. The harness's results, log-likelihoods
    (1e-5 per token) and greedy generations equal those of the one-process model."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tasks=TASKS, pairs=PAIRS, prompts=PROMPTS,
                                    generation=GENERATION))
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM_", "OMPI_", "TPU_", "TFM_"))}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               HF_DATASETS_OFFLINE="1", TFM_COORDINATOR=f"localhost:{port}",
               TFM_NUM_PROCESSES="2", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    procs = [subprocess.Popen(
        [sys.executable, str(script), str(process_id), str(run_dir), str(tmp_path)],
        env={**env, "TFM_PROCESS_ID": str(process_id)}, cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT) for process_id in range(2)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for proc in procs:  # never leave a process waiting for its peer
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for process_id, proc in enumerate(procs):
        assert proc.returncode == 0, f"process {process_id} failed:\n{logs[process_id][-3000:]}"
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    for task in TASKS:
        for metric, value in harness_results[task].items():
            if isinstance(value, float):
                assert results[task][metric] == pytest.approx(value, rel=1e-6, abs=1e-9), (
                    task, metric)
    shared = json.loads((tmp_path / "requests.json").read_text())
    alone = model.loglikelihood(requests("loglikelihood", PAIRS))
    for (total, greedy), (want, want_greedy), (_, continuation) in zip(
            shared["pairs"], alone, PAIRS, strict=True):
        assert total == close(want, len(continuation))
        assert greedy == want_greedy
    assert shared["texts"] == model.generate_until(requests("generate_until", [
        (prompt, GENERATION) for prompt in PROMPTS]))


WORD_TASKS = ["tfm_words_choice", "tfm_words_rolling", "tfm_words_generate"]


def test_an_exported_gpt2_scores_the_same_under_hf_and_tfm(tmp_path, monkeypatch):
    """A GPT-2-family model fine-tuned by tfm (3 steps from tests/fixtures/hf/gpt2, its word
    tokenizer) and exported with save_pretrained: the harness's own `hf` model (torch,
    transformers) and `tfm` (pretrained=) give each request the same log-likelihood (1e-4) and
    is_greedy, the same generations, hence the same results. Skipped without torch."""
    import json
    import shutil

    for module in ("torch", "transformers", "accelerate"):  # the harness's hf model needs them
        pytest.importorskip(module)
    from lm_eval.tasks import TaskManager

    from tfm.interop import hf
    from tfm.training import train

    folder = tmp_path / "gpt2"
    shutil.copytree(REPO / "tests" / "fixtures" / "hf" / "gpt2", folder)
    corpus = tmp_path / "words.txt"
    corpus.write_text("".join(f"w{i} w{i + 1} w{i + 2}\n" for i in range(1, 60)))
    config = char_lm.get_config("runlocal")
    config.data.update(path=str(corpus), text_unit="line", seq_len=16, eval_seq_len=16,
                       batch_size=8, eval_batch_size=8, tokenizer=f"hf:{folder}",
                       data_dir=str(tmp_path / "data"))
    config.optimizer.update(total_steps=3, warmup_steps=1)
    config.train.update(num_steps=3, log_every=1, eval_every=0, checkpoint_every=3,
                        progress_bar=False)
    config.eval.max_batches = 1
    config.generate.max_new_tokens = 4  # the fixture has 16 learned positions
    config.init.pretrained = str(folder)
    train.train_and_evaluate(config, tmp_path / "run")
    trained = adapter.TfmLM(workdir=str(tmp_path / "run"))
    exported = tmp_path / "exported"
    assert hf.save_pretrained(trained.config, trained.params, exported) == "gpt2"
    shutil.copy(folder / "tokenizer.json", exported / "tokenizer.json")
    # Without it transformers reads a gpt2 folder's tokenizer as GPT-2's byte-level BPE.
    (exported / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w63", "eos_token": "w63",
        "unk_token": "w0"}))

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def run(model, model_args=None) -> dict:
        return lm_eval.simple_evaluate(
            model=model, model_args=model_args, tasks=WORD_TASKS, batch_size=4,
            task_manager=TaskManager(include_path=str(FIXTURES)), log_samples=True)

    under_hf = run("hf", f"pretrained={exported},dtype=float32,device=cpu")
    under_tfm = run(adapter.TfmLM(pretrained=str(exported), batch_size=4))
    differences, generated = [], []
    for task in WORD_TASKS:
        hf_samples = sorted(under_hf["samples"][task], key=lambda sample: sample["doc_id"])
        tfm_samples = sorted(under_tfm["samples"][task], key=lambda sample: sample["doc_id"])
        assert len(hf_samples) == len(tfm_samples) > 0
        for hf_sample, tfm_sample in zip(hf_samples, tfm_samples, strict=True):
            assert hf_sample["arguments"] == tfm_sample["arguments"]
            for hf_answer, tfm_answer in zip(hf_sample["resps"], tfm_sample["resps"],
                                             strict=True):
                [hf_answer], [tfm_answer] = hf_answer, tfm_answer
                if task == "tfm_words_generate":
                    assert tfm_answer == hf_answer
                    generated.append(tfm_answer)
                    continue
                hf_total, tfm_total = hf_answer, tfm_answer  # rolling: the document's sum
                if task == "tfm_words_choice":  # (log-likelihood, is_greedy)
                    assert tfm_answer[1] == hf_answer[1]
                    hf_total, tfm_total = hf_answer[0], tfm_answer[0]
                differences.append(abs(tfm_total - hf_total))
                assert tfm_total == pytest.approx(hf_total, abs=1e-4), (task, hf_sample["doc_id"])
    assert sum(map(bool, generated)) >= len(generated) // 2  # words, not only empty strings
    print(f"largest log-likelihood difference, hf vs tfm: {max(differences):.2e}; "
          f"generations: {generated}")
    for task in WORD_TASKS:
        for metric, value in under_hf["results"][task].items():
            if isinstance(value, float):
                assert under_tfm["results"][task][metric] == pytest.approx(value, rel=1e-4), (
                    task, metric)
