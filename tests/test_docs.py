"""The README and the documentation site (docs/, mkdocs.yml) stay true:

- `mkdocs build --strict` passes, so a broken link or anchor, a page missing from the nav, or an
  API reference (`::: tfm.x`) to a module that no longer exists fails the suite;
- README.md is the front door: at most 250 lines, every relative link points to a file, and its
  install and test commands are the ones .ci/run runs;
- the code the README and docs/library.md show really runs.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 250


def _python_block(markdown: Path, heading: str) -> str:
    """The first ```python block after `heading` in a Markdown file."""
    text = markdown.read_text()
    assert heading in text, f"{markdown.name} has no heading {heading!r}"
    after = text[text.index(heading):]
    match = re.search(r"```python\n(.*?)```", after, re.S)
    assert match, f"no python block after {heading!r} in {markdown.name}"
    return match.group(1)


def _bash_lines(markdown_text: str) -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", markdown_text, re.S):
        lines += [line.split("  #")[0].strip() for line in block.splitlines()]
    return lines


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason='mkdocs is not installed: pip install -e ".[docs]"')
def test_the_documentation_builds_strictly(tmp_path):
    """Warnings (broken links and anchors, files outside the nav) abort a --strict build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    api = (tmp_path / "api" / "nn" / "index.html").read_text()
    assert "dot_product_attention" in api  # the reference is generated from the docstrings
    performance = (tmp_path / "benchmarks" / "index.html").read_text()
    assert "every figure, with the command behind it" in performance  # benchmarks/README.md


def test_readme_is_the_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; keep it at most {MAX_README_LINES} and move the "
        "rest to a page in docs/")


def test_readme_relative_links_point_to_files():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    missing = []
    for target in targets:
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if not (ROOT / path).exists():
            missing.append(target)
    assert not missing, f"README.md links to missing files: {missing}"


def test_ci_runs_the_readme_install_and_test_commands():
    commands = _bash_lines(README.read_text())
    install = next(line for line in commands if line.startswith("python -m pip install -e"))
    test = next(line for line in commands if line.startswith("python -m pytest"))
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install in ci and test in ci, (install, test, ci)


def test_the_readme_example_runs(capsys):
    exec(compile(_python_block(README, "## Use the modules in your own code"), "README.md", "exec"),
         {"__name__": "readme_example"})
    assert "[[" in capsys.readouterr().out  # out.tokens printed


def test_the_sharded_training_step_of_the_docs_runs(capsys):
    """docs/library.md's step on the 8 simulated CPU devices of tests/conftest.py."""
    import jax

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py simulates 8 CPU devices)")
    code = _python_block(ROOT / "docs" / "library.md", "## A sharded training step")
    exec(compile(code, "docs/library.md", "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    losses = [float(value) for value in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out
    assert "P('fsdp', 'tensor')" in out  # [d_model, d_ff] over fsdp x tensor
