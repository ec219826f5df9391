"""GPTQ onto 4-bit groups (Frantar et al., 2022), the grid of GPTQ checkpoints: each weight column
rounded in turn, its error moved onto the columns not yet rounded through the inverse Hessian
of the layer's inputs (model/fp8_gptq.py does the same onto the FP8 grid; this is its 4-bit
form). A group's scale and zero point are fixed when its first column is reached, from its
columns as the updates so far left them (as AutoGPTQ does without static groups); with
act-order the columns go by decreasing H[i, i] and the groups follow that order, so g_idx
scatters. `gptq_w4a16_tensors` runs it over a whole model on calibration text, layer by layer
(model/gptq_calibration.py), for `make-w4a16-checkpoint --gptq`."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def _group_params(w: torch.Tensor, sym: bool, min_zero: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float16-rounded, as stored) and zero point [rows, 1] of the columns `w` [rows, g]."""
    if sym:
        scale = (w.abs().amax(-1, keepdim=True) * 2 / 15).clamp(min=1e-10)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        zero = torch.round(-lo / scale).clamp(min_zero, 15)
    return scale.to(torch.float16).to(torch.float32), zero


def gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, sym: bool, act_order: bool = False,
              damp: float = 0.01, block: int = 128, min_zero: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`weight` [rows, cols] rounded onto 4-bit groups by GPTQ against `hessian` [cols, cols]:
    (q uint8 [rows, cols], scales float32 [rows, G], zeros uint8 [rows, G], g_idx int32 [cols]), as
    `w4a16_checkpoint.quantize_groups` returns them (with H a multiple of the identity and no
    act-order, the same rounding)."""
    w = weight.detach().to(torch.float32).clone()
    rows, cols = w.shape
    size = cols if group_size == -1 else group_size
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(cols, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(cols, dtype=h.dtype, device=h.device)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
    q = torch.empty(rows, cols, dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows, cols // size, device=w.device)
    zeros = torch.empty(rows, cols // size, device=w.device)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        wb = w[:, b0:b1].clone()
        ub = u[b0:b1, b0:b1]
        errors = torch.empty_like(wb)
        for i in range(b1 - b0):
            c = b0 + i
            if c % size == 0:  # this group's grid, from the weights as earlier blocks left them
                g = c // size
                s, z = _group_params(torch.cat([wb[:, i : i + size], w[:, b1 : c + size]], dim=1), sym, min_zero)
                scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
            s, z = scales[:, c // size : c // size + 1], zeros[:, c // size : c // size + 1]
            col = wb[:, i : i + 1]
            qc = torch.clamp(torch.round(col / s) + z, 0, 15)
            q[:, c] = qc[:, 0].to(torch.uint8)
            err = (col - (qc - z) * s) / ub[i, i]
            wb[:, i + 1 :] -= err @ ub[i : i + 1, i + 1 :]
            errors[:, i : i + 1] = err
        w[:, b1:] -= errors @ u[b0:b1, b1:]
    g_idx = torch.empty(cols, dtype=torch.int32, device=w.device)
    g_idx[perm] = (torch.arange(cols, device=w.device) // size).to(torch.int32)
    inverse = torch.argsort(perm)
    return q[:, inverse], scales, zeros.to(torch.uint8), g_idx


def dequantized(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    g = g_idx.long()
    return (q.to(torch.float32) - zeros.to(torch.float32)[:, g]) * scales[:, g]


def gptq_w4a16_tensors(source: Path, arch, gptq, group_size: int, sym: bool, act_order: bool,
                       min_zero: int) -> dict[str, tuple[torch.Tensor, ...]]:  # fmt: skip
    """(q, scales, zeros, g_idx) by checkpoint weight name (`...q_proj.weight`) for every
    projection, GPTQ-rounded on the model as llmserve runs it (float32 on a CPU) over `gptq`'s
    calibration text (fp8_checkpoint.GptqCalibration). A fused projection's parts share its
    Hessian, so q/k/v (gate/up) get one input order."""
    from llmserve.model.attention import reference_paged_attention
    from llmserve.model.fp8 import projection_parts
    from llmserve.model.gptq_calibration import calibration_windows, gptq_model, read_calibration_texts
    from llmserve.model.loader import load_model
    from llmserve.tokenizer import load_tokenizer

    device = ("cuda" if torch.cuda.is_available() else "cpu") if gptq.device == "auto" else gptq.device
    windows = calibration_windows(read_calibration_texts(list(gptq.texts), load_tokenizer(str(source))),
                                  gptq.window, gptq.tokens)  # fmt: skip
    model = load_model(str(source), arch, torch.float32, device, reference_paged_attention, progress=False,
                       max_positions=gptq.window)  # fmt: skip
    started = time.perf_counter()

    def round_weight(weight: torch.Tensor, hessian: torch.Tensor):
        out = gptq_int4(weight, hessian, group_size, sym, act_order, gptq.options.damp, gptq.options.block, min_zero)
        return out, dequantized(*out)

    def progress(report, _done) -> None:
        print(f"GPTQ 4-bit: layer {report.layer + 1}/{arch.num_layers} rounded ({report.seconds:.1f} s, "
              f"{time.perf_counter() - started:.0f} s in all)", flush=True)  # fmt: skip

    print(f"GPTQ 4-bit: {len(windows)} calibration windows of {gptq.window} tokens, on {device}", flush=True)
    fused = gptq_model(model, windows, set(), gptq.options, on_layer=progress, round_weight=round_weight)
    parts = projection_parts(arch)
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, (q, scales, zeros, g_idx) in fused.items():
        names = parts[name]
        widths = model.fused_widths(name + ".weight") if len(names) > 1 else [q.shape[0]]
        start = 0
        for part, width in zip(names, widths):
            rows = slice(start, start + width)
            out[part + ".weight"] = (q[rows].cpu(), scales[rows].cpu(), zeros[rows].cpu(), g_idx.cpu())
            start += width
    return out
