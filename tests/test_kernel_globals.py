"""Every Triton kernel reads only globals that Triton's compiler accepts.

Under TRITON_INTERPRET (the CPU tests) a `@triton.jit` function may read any module global; the
compiler on a GPU takes only `tl.constexpr` values, other jitted functions, modules and a few
builtins, and fails with "Cannot access global variable ... from within @jit'ed function" (the
fused MoE kernels' FP8 modes did, first seen on an H100). This walks each kernel's source and
checks what every free name resolves to, on the CPU, without compiling."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import llmserve.kernels  # noqa: E402

pytestmark = pytest.mark.unit

# `triton.jit` gives an InterpretedFunction where TRITON_INTERPRET was set before triton's import
JITTED = (triton.runtime.jit.JITFunction, triton.runtime.interpreter.InterpretedFunction)


def _kernels() -> list[tuple[str, object]]:
    found = []
    for info in pkgutil.iter_modules(llmserve.kernels.__path__):
        module = importlib.import_module(f"llmserve.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, JITTED) and value.fn.__module__ == module.__name__:
                found.append((f"{info.name}.{name}", value))
    return found


def _free_names(fn) -> set[str]:
    """Names the function reads that it neither takes nor assigns."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    bound = {a.arg for a in func.args.args + func.args.kwonlyargs}
    loads = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.For, ast.comprehension)):
            for target in ast.walk(node.target):
                if isinstance(target, ast.Name):
                    bound.add(target.id)
    return loads - bound


def _allowed(value) -> bool:
    return isinstance(value, (types.ModuleType, tl.constexpr, *JITTED)) or (
        callable(value) and getattr(value, "__module__", "").startswith("triton")
    )


KERNELS = _kernels()


def test_the_kernels_are_found():
    names = {name for name, _ in KERNELS}
    assert len(KERNELS) > 20
    assert {"fused_moe._gate_up_kernel", "fresh_prefill._fresh_prefill_kernel"} <= names


@pytest.mark.parametrize(("name", "kernel"), KERNELS, ids=[name for name, _ in KERNELS])
def test_a_kernel_reads_only_constexpr_globals(name, kernel):
    fn = kernel.fn
    bad = {}
    for free in sorted(_free_names(fn)):
        if free in fn.__globals__:
            if not _allowed(fn.__globals__[free]):
                bad[free] = type(fn.__globals__[free]).__name__
        elif not hasattr(builtins, free):
            bad[free] = "undefined"
    assert bad == {}, f"{name} reads globals the GPU compiler refuses: {bad} (make them tl.constexpr)"
