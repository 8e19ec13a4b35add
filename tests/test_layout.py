"""The package's shape: folders that show the architecture, imports that run one way (no
circles, also through imports inside functions; kernels below nn, data below training), short
functions and files, platform tricks only behind the kernel boundary (tfm/kernels/), masks
passed by parts from the model (dense ones written out only in tfm/kernels/), family names
compared only in tfm/nn/families.py, and benchmarks that import the installed package.

Each detector also runs on a small bad example here, so a check that could never fail shows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tfm
from tfm.nn.families import FAMILIES

PACKAGE = Path(tfm.__file__).parent
BENCHMARKS = PACKAGE.parent / "benchmarks"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600
MAX_TOP_LEVEL_MODULES = 8
# (importer, imported): a module under the first may import nothing under the second.
FORBIDDEN_IMPORTS = (("tfm.kernels", "tfm.nn"), ("tfm.data", "tfm.training"))


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` outside `if TYPE_CHECKING:` blocks."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return nodes


def _module_imports(name: str, source: str, modules: dict[str, Path]) -> set[str]:
    """The tfm modules `name` imports, anywhere in its source (an import inside a function is
    still an import), with the packages whose __init__ those imports run first. Imports under
    `if TYPE_CHECKING:` never run: they only name types for annotations."""
    imported = set()
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfm"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                imported.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names if alias.name.startswith("tfm")}
    found = {module for module in imported if module in modules}
    for module in list(found):
        parts = module.split(".")
        for end in range(2, len(parts)):
            package = ".".join(parts[:end])
            if package in modules and not _under(name, package):
                found.add(package)  # importing tfm.nn.x runs tfm/nn/__init__.py first
    return found - {name}


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: _module_imports(name, path.read_text(), modules)
            for name, path in modules.items()}


def _import_circle(graph: dict[str, set[str]]) -> str | None:
    """One import circle of `graph` as "a -> b -> a", or None."""
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> str | None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return " -> ".join([*stack, name, other])
            if other not in state and (circle := visit(other, [*stack, name])):
                return circle
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (circle := visit(name, [])):
            return circle
    return None


def _forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{name} imports {other}" for name, imported in sorted(graph.items())
            for other in sorted(imported) for lower, upper in FORBIDDEN_IMPORTS
            if _under(name, lower) and _under(other, upper)]


def test_no_import_circle():
    circle = _import_circle(_import_graph(_modules()))
    assert circle is None, circle


def test_kernels_import_no_nn_and_data_imports_no_training():
    forbidden = _forbidden_imports(_import_graph(_modules()))
    assert not forbidden, forbidden


def test_the_import_checks_see_imports_inside_functions():
    modules = {name: Path() for name in ("tfm.a", "tfm.b", "tfm.kernels", "tfm.nn", "tfm.nn.x")}
    graph = {
        "tfm.a": _module_imports("tfm.a", "from tfm import b\n", modules),
        "tfm.b": _module_imports("tfm.b", "def f():\n    import tfm.a\n", modules),
        "tfm.kernels": _module_imports("tfm.kernels", "def f():\n    from tfm.nn.x import y\n",
                                       modules),
        "tfm.nn": _module_imports("tfm.nn", "if TYPE_CHECKING:\n    from tfm import kernels\n",
                                  modules),
        "tfm.nn.x": set(),
    }
    assert graph["tfm.nn"] == set()
    assert _import_circle(graph) == "tfm.a -> tfm.b -> tfm.a"
    assert _forbidden_imports(graph) == ["tfm.kernels imports tfm.nn",
                                         "tfm.kernels imports tfm.nn.x"]


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


# What writes out a [.., q_len, kv_len] mask or bias: the reference's mask functions and
# tfm.kernels.masks. Only kernels call them; the model passes the structure by parts.
DENSE_MASK_BUILDERS = frozenset({
    "causal_mask", "padding_mask", "segment_mask", "local_window_mask", "combine_masks",
    "dense_mask", "dense_bias", "dense_position_bias", "dense_call", "dense_from_blocks",
    "reference_attention"})


def _dense_mask_uses(source: str) -> list[str]:
    """Lines that call a dense-mask builder, or pass a dense mask or bias to an attention call."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func).rsplit(".", 1)[-1]
        if name in DENSE_MASK_BUILDERS:
            found.append(f"line {node.lineno}: {name}(...)")
        elif name.endswith("attention") and {"mask", "bias"} & {k.arg for k in node.keywords}:
            found.append(f"line {node.lineno}: {name}(mask=/bias=...)")
    return found


def test_the_model_passes_masks_by_parts():
    """tfm/nn describes each mask and position bias by its parts (AttentionStructure); only
    the kernels that read a dense mask write one out (tfm.kernels.masks)."""
    found = [f"{name} {use}" for name, path in sorted(_modules().items())
             if name.startswith("tfm.nn") for use in _dense_mask_uses(path.read_text())]
    assert not found, found


def test_the_dense_mask_check_sees_builders_and_dense_arguments():
    source = """
mask = attention.combine_masks(a, b)
mask = causal_mask(q, k)
out = kernels.attention(q, k, v, mask=mask, backend=name)
out = kernels.attention(q, k, v, structure=structure)
valid = attention.valid_from_lengths(lengths, 4)
"""
    lines = [use.split(":")[0] for use in _dense_mask_uses(source)]
    assert sorted(lines) == ["line 2", "line 3", "line 4"]


def _family_name_uses(source: str, names: frozenset[str]) -> list[str]:
    """Lines that compare a family name (==, !=, in, case) or key a dict by family names.

    A dict with one key "encoder" is a parameter tree (params["encoder"]), not a family table,
    so dict keys count from two family names or one that is no module name."""

    def is_name(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops
        ):
            for operand in (node.left, *node.comparators):
                items = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) else [
                    operand]
                if any(map(is_name, items)):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
                    break
        elif isinstance(node, ast.MatchValue) and is_name(node.value):
            found.append(f"line {node.lineno}: case {node.value.value!r}")
        elif isinstance(node, ast.Dict):
            keys = {key.value for key in node.keys if is_name(key)}
            if len(keys) >= 2 or keys - {"encoder"}:
                found.append(f"line {node.lineno}: a dict keyed by {sorted(keys)}")
    return found


def test_family_names_are_compared_only_in_the_registry():
    """tfm/nn/families.py owns what differs between families: elsewhere, code asks the entry."""
    names = frozenset(FAMILIES)
    found = [f"{name} {use}" for name, path in sorted(_modules().items())
             if name != "tfm.nn.families"
             for use in _family_name_uses(path.read_text(), names)]
    assert not found, found


def test_the_family_check_sees_comparisons_cases_and_tables():
    source = """
if config.mode == "seq2seq": pass
if mode in ("lm", "x"): pass
match mode:
    case "lm": pass
counts = {"lm": 1, "seq2seq": 2}
params = {"encoder": 1, "decoder": 2}
if "x" != name: pass
"""
    lines = [use.split(":")[0] for use in _family_name_uses(source, frozenset(FAMILIES))]
    assert sorted(lines) == ["line 2", "line 3", "line 5", "line 6"]


def _long_files(paths: dict[str, Path]) -> list[str]:
    lengths = {name: len(path.read_text().splitlines()) for name, path in paths.items()}
    return [f"{name}: {lines} lines" for name, lines in sorted(lengths.items())
            if lines > MAX_FILE_LINES]


def test_no_library_file_is_longer_than_600_lines():
    long = _long_files(_modules())
    assert not long, long


def test_the_file_length_check_counts_lines(tmp_path):
    short, long = tmp_path / "short.py", tmp_path / "long.py"
    short.write_text("x = 1\n" * MAX_FILE_LINES)
    long.write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert _long_files({"short": short, "long": long}) == [f"long: {MAX_FILE_LINES + 1} lines"]


# sys.path edited in code or in the code a script runs in a child process (a string).
SYS_PATH_EDIT = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend)\b|\[[^\]]*\]\s*=|\+?=(?!=))")


def test_benchmarks_import_the_installed_package():
    """No benchmark puts the checkout on sys.path: they run against the installed tfm
    (benchmarks/README.md says how they find each other)."""
    edits = [f"{path.name}:{number}: {line.strip()}"
             for path in sorted(BENCHMARKS.glob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if SYS_PATH_EDIT.search(line)]
    assert not edits, edits


def test_the_sys_path_check_sees_each_kind_of_edit():
    edits = ["sys.path.insert(0, str(ROOT))", "sys.path.append(ROOT)", "sys.path += [ROOT]",
             "sys.path = [ROOT, *sys.path]", "sys.path[:0] = [ROOT]", 'code = "sys.path.extend(x)"']
    reads = ["print(sys.path)", "if ROOT in sys.path: pass", "sys.path == other"]
    assert all(SYS_PATH_EDIT.search(line) for line in edits)
    assert not any(SYS_PATH_EDIT.search(line) for line in reads)
