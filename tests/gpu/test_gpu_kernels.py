"""Every Triton kernel against its PyTorch reference on the GPU, at Llama-3.1-8B-like shapes and
others (other GQA ratios, head dims, dtypes): paged attention on mixed batches, fresh prompts and
later chunks by SDPA, decode batches with and without split-KV, the KV write, the fused norms, rotary
and the activations. The cases live in scripts/gpu/bench_kernels.py (`checks`), beside the same
kernels' timings and tile sweeps; the CPU tests run the kernels under Triton's interpreter
(tests/test_kernels.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from gpu_utils import free_device_memory  # noqa: F401

pytestmark = pytest.mark.gpu


def test_every_kernel_within_tolerance_of_its_reference():
    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bench_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_kernels)
    bench_kernels.checks(quick=False)
    results = bench_kernels.RESULTS
    assert [e for e in results["errors"] if e.get("section") == "checks"] == []
    assert results["checks"], "no check ran"
    failed = [(c["name"], c["max_abs_err"], c["tol"]) for c in results["checks"] if not c["ok"]]
    assert failed == []
