"""The package's shape: folders that show the architecture, no import circles, short functions,
and platform tricks only behind the kernel boundary (tfm/kernels/)."""

from __future__ import annotations

import ast
from pathlib import Path

import tfm

PACKAGE = Path(tfm.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_TOP_LEVEL_MODULES = 8


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tfm modules `name` imports when it is loaded (module-level imports only)."""
    imported = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfm"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                imported.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names if alias.name.startswith("tfm")}
    return {module for module in imported if module in modules and module != name}


def test_no_import_circle():
    modules = _modules()
    graph = {name: _module_imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            assert state.get(other) != "open", " -> ".join([*stack, name, other])
            if other not in state:
                visit(other, [*stack, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_few_modules_directly_under_tfm_and_the_public_names_import():
    top_level = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top_level) <= MAX_TOP_LEVEL_MODULES, top_level
    for name in tfm.__all__:
        assert getattr(tfm, name) is not None, name


def test_no_function_is_longer_than_80_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long


def test_platform_tricks_stay_behind_the_kernel_boundary():
    """The model package reads like the paper: no optimization barriers, custom VJPs, XLA
    options or CPU detection outside tfm/kernels/."""
    tricks = ("optimization_barrier", "custom_vjp", "compiler_options", "/proc/cpuinfo",
              "bitcast_convert_type")
    found = []
    for name, path in _modules().items():
        if name.startswith("tfm.kernels"):
            continue
        text = path.read_text()
        found += [f"{name}: {trick}" for trick in tricks if trick in text]
    assert not found, found
