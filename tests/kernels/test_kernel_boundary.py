"""The kernel boundary's import direction: tfm.kernels (the reference maths at the bottom, the
platform kernels above it) imports nothing from tfm.nn, at module level or inside a function,
and importing the model loads no Pallas kernel until one is used."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tfm.kernels

KERNELS = Path(tfm.kernels.__file__).parent


def _tfm_imports(path: Path) -> set[str]:
    """Every tfm module `path` imports, anywhere in the file (functions included)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfm"):
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names if alias.name.startswith("tfm")}
    return imported


def test_kernels_import_nothing_from_the_model():
    found = {
        str(path.relative_to(KERNELS)): sorted(
            name for name in _tfm_imports(path) if name.startswith("tfm.nn") or name == "tfm.nn"
        )
        for path in sorted(KERNELS.rglob("*.py"))
    }
    assert not {path: names for path, names in found.items() if names}


def test_the_reference_imports_nothing_from_tfm():
    assert _tfm_imports(KERNELS / "reference.py") == set()


def test_importing_the_model_loads_no_pallas_kernel():
    probe = (
        "import sys, tfm.nn, tfm.nn.config, tfm.nn.models, tfm.nn.attention\n"
        "loaded = [m for m in sys.modules if 'splash' in m or m.startswith("
        "'jax.experimental.pallas') or m in ('tfm.kernels.flex_attention', "
        "'tfm.kernels.tpu_attention', 'tfm.kernels.fused_cross_entropy')]\n"
        "print(loaded)\n"
        "from tfm import kernels\n"
        "print(kernels.flex_attention.__name__)\n"
    )
    lines = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert lines == ["[]", "tfm.kernels.flex_attention"]  # none loaded; one on first use


def test_the_model_names_the_reference_functions():
    from tfm.kernels import reference
    from tfm.nn import attention, dense

    assert attention.dot_product_attention is reference.dot_product_attention
    assert attention.causal_mask is reference.causal_mask
    assert dense.linear is reference.linear
