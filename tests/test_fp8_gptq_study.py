"""GPTQ onto the FP8 E4M3 grid (llmserve/model/fp8_gptq.py, used by scripts/studies/fp8_gptq.py)."""

from __future__ import annotations

import pytest
import torch

from llmserve.model.fp8 import FP8, quantize_rows
from llmserve.model.fp8_gptq import dequantize, gptq_fp8, input_hessian

pytestmark = pytest.mark.unit


def _layer(seed: int = 0, tokens: int = 1024, cols: int = 192, rows: int = 48):
    g = torch.Generator().manual_seed(seed)
    # correlated inputs, as a layer's are: a few directions carry most of their energy
    x = torch.randn(tokens, 32, generator=g) @ torch.randn(32, cols, generator=g) + 0.3 * torch.randn(
        tokens, cols, generator=g
    )
    w = torch.randn(rows, cols, generator=g) * 0.05
    return x, w


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_below_round_to_nearest(act_order):
    x, w = _layer()
    q, scale = gptq_fp8(w, input_hessian(x), damp=0.01, block=64, act_order=act_order)
    rtn, rtn_scale = quantize_rows(w)
    assert q.dtype == FP8 and q.shape == w.shape and torch.equal(scale, rtn_scale)  # same grid, same scales
    ref = x @ w.t()
    gptq_err = (ref - x @ dequantize(q, scale, torch.float32).t()).norm()
    rtn_err = (ref - x @ dequantize(rtn, rtn_scale, torch.float32).t()).norm()
    assert gptq_err < 0.5 * rtn_err  # about 0.3 (column order) and 0.25 (act order)


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    _, w = _layer()
    q, scale = gptq_fp8(w, 3.0 * torch.eye(w.shape[1], dtype=torch.float64), block=50)
    rtn, rtn_scale = quantize_rows(w)
    assert torch.equal(q.float(), rtn.float()) and torch.equal(scale, rtn_scale)


def test_gptq_dead_inputs_and_shape_check():
    x, w = _layer(tokens=256)
    x[:, :5] = 0.0  # inputs never seen
    q, scale = gptq_fp8(w, input_hessian(x))
    assert torch.isfinite(dequantize(q, scale, torch.float32)).all()
    with pytest.raises(ValueError):
        gptq_fp8(w, torch.eye(w.shape[1] + 1, dtype=torch.float64))
