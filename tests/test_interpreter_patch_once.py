"""tests/interpreter_patch_once.py (conftest installs it under Triton's interpreter): kernels that call
@triton.jit helpers compute bit for bit what they compute under Triton's own `_patch_lang`, and the
helpers' calls take the shortcut (an empty patch scope) while a launch's own patch still runs."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.unit


def _attention_and_norm() -> list[torch.Tensor]:
    """Paged attention (its key loop calls `_attend_range`) and a fused add-RMSNorm, seeded."""
    from test_kernels import make_batch

    from llmserve.kernels import norm, paged_attention

    q, _, _, cache, meta = make_batch([1, 9], [20, 9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                                      dtype=torch.float32, seed=3)  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    x, residual, weight = (torch.randn(3, 40, generator=gen) for _ in range(3))
    out, res = norm.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    return [paged_attention.paged_attention_forward(q, cache, meta, 0.25, num_splits=2), out, res]


def test_helpers_skip_the_repatch_and_compute_the_same(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("only under Triton's interpreter (conftest installs it there)")
    from triton.runtime import interpreter

    tl = interpreter.tl
    patch_lang = interpreter._patch_lang
    assert getattr(patch_lang, "patched_once", False), "conftest did not install interpreter_patch_once"
    calls = {"launch": 0, "helper": 0, "shortcut": 0}

    def counting(fn):  # a launch starts on the plain language; a helper is called inside a launch
        calls["launch" if tl.core.is_builtin(tl.load) else "helper"] += 1
        scope = patch_lang(fn)
        calls["shortcut"] += not scope._changes  # an empty scope: nothing patched again
        return scope

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    fast = _attention_and_norm()
    # every helper's call took the shortcut but perhaps one: Triton's own helpers (tl.max, tl.sum: in
    # triton.language.standard) also see triton.language.core, which Triton's _patch_lang patches at the
    # first such call of the process (and leaves patched)
    assert calls["launch"] >= 3 and calls["helper"] > calls["launch"] and calls["shortcut"] >= calls["helper"] - 1, (
        calls
    )
    monkeypatch.setattr(interpreter, "_patch_lang", patch_lang.original)  # Triton's own, at every helper call
    plain = _attention_and_norm()
    assert all(torch.equal(a, b) for a, b in zip(fast, plain))
    assert tl.core.is_builtin(tl.load)  # every launch restored the language
