"""Kernels compiled for a Hopper GPU (sm_90) on this CPU machine: a script that calls
`triton.compile` per kernel variant (printing "compiled" for each) run in a process of its own,
without TRITON_INTERPRET (the interpreter runs a kernel's Python, not Triton's compiler) and over a
fresh Triton cache, so every variant really compiles. Used by test_kernel_compile.py,
test_int8_kernels.py and test_quant_split_k.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def compile_script(script: str, cache_dir: Path, timeout: float = 300) -> str:
    """Run `script` that way; its stdout once it exited 0 (else the assertion shows its stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
