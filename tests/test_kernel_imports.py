"""The kernels' import boundary (issue 50): a module under `llmserve/kernels/` imports torch, triton,
`llmserve.model` or top-level llmserve modules, never `llmserve.engine` (the engine depends on the
kernels, not the other way round). Read from the source with `ast`, so an import inside a function
or under `TYPE_CHECKING` counts too, and nothing is executed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import llmserve

pytestmark = pytest.mark.unit

KERNELS = Path(llmserve.__file__).parent / "kernels"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file; a relative import resolved against its package."""
    package = "llmserve.kernels"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            # `from llmserve import engine` names the package in the alias
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def engine_imports(path: Path) -> list[str]:
    return [f"{path.name}:{line} {module}" for line, module in imported_modules(path)
            if module == "llmserve.engine" or module.startswith("llmserve.engine.")]  # fmt: skip


def test_no_kernel_module_imports_the_engine():
    files = sorted(KERNELS.rglob("*.py"))
    assert len(files) > 10
    assert [hit for path in files for hit in engine_imports(path)] == []


def test_the_check_sees_every_spelling_of_an_engine_import(tmp_path):
    spellings = ["from llmserve.engine.host_copy import to_device", "import llmserve.engine.sampler",
                 "from llmserve import engine", "from ..engine import host_copy",
                 "def f():\n    from llmserve.engine import host_copy"]  # fmt: skip
    for i, source in enumerate(spellings):
        path = tmp_path / f"m{i}.py"
        path.write_text(source + "\n")
        assert engine_imports(path), source
    path = tmp_path / "fine.py"
    path.write_text("import torch\nfrom llmserve.host_copy import to_device\nfrom llmserve.model import layers\n"
                    "from . import pdl\nfrom .engine_like import x\n")  # fmt: skip
    assert engine_imports(path) == []
