"""AWQ's activation-aware scales (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization"),
written here from the paper's idea for `make-w4a16-checkpoint --method awq --calibration-text`.

A few input channels carry large activations; their weights matter most, yet round to nearest
gives them the same relative error as the rest. Scaling input channel j of a projection's weight
up by s_j (and its input down by s_j) leaves the float product unchanged and gives those weights
finer steps of the group grid. Per group of projections that read one input:
- s_x, the mean |x| per input channel on calibration text (the float model as llmserve runs it,
  float32, layer by layer through model/gptq_calibration.py's hooks, which also sum X^T X);
- for alpha in 0, 0.05, ..., 1: s = s_x^alpha, normalised by sqrt(max s * min s); W s rounded
  to nearest per group with zero points (`quantize_groups`); the output error
  ||(Q(W s) / s - W) X^T||^2 = trace(D H D^T), D = Q(W s) / s - W, H = X^T X; the alpha with the
  least error wins (alpha 0 is round to nearest, so on the calibration data the result is never
  worse than it, layer by layer);
- 1/s is folded into the op before: the RMSNorm weight for q/k/v (input_layernorm) and gate/up
  (post_attention_layernorm); up_proj's rows for down_proj (act = silu(gate) * up, so up's output
  divided by s divides act by s); v_proj's rows for o_proj (the attention output of head h is a
  convex mix of v's rows of its KV head, so dividing those rows by s divides it by s). With GQA
  several query heads read one KV head, so o_proj's channels are given one scale per KV-head
  channel (s_x averaged over the heads of a KV group): the fold stays exact.
The folded model computes the float model's function (up to the checkpoint dtype's rounding of
the folded tensors); its projections are then rounded to nearest as before. Next layers' inputs
come from the float model (as AutoAWQ does). No weight-clipping search (AutoAWQ's second step).
Llama-family folders (plain RMSNorm weights: llama, mistral, qwen2, qwen3)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

ALPHAS = tuple(i / 20 for i in range(21))
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# a fused projection (its path in a decoder layer) -> what absorbs 1/s: ("norm", the RMSNorm) or
# ("rows", the checkpoint projection whose output rows are divided)
ABSORBED_BY = {
    "self_attn.qkv_proj": ("norm", "input_layernorm"),
    "self_attn.o_proj": ("rows", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("norm", "post_attention_layernorm"),
    "mlp.down_proj": ("rows", "mlp.up_proj"),
}


@dataclass(frozen=True, slots=True)
class AwqCalibration:
    """`make-w4a16-checkpoint --method awq --calibration-text`: activation-aware scales searched on
    windows of these UTF-8 texts, round robin, `tokens` in all."""

    texts: tuple[str, ...]
    tokens: int = 8192
    window: int = 512
    alphas: tuple[float, ...] = ALPHAS
    device: str = "auto"  # cuda when there is one


@dataclass(frozen=True, slots=True)
class AwqScale:
    scale: torch.Tensor  # float32 [K]: input channel j of the projection's weight is multiplied by it
    alpha: float
    error: float  # the output error trace(D H D^T) at alpha
    error_rtn: float  # ... at alpha 0 (round to nearest)


def _check_family(arch) -> None:
    if arch.family not in FAMILIES:
        raise ValueError(f"AWQ scales fold into plain RMSNorm weights: {arch.architecture} is not read "
                         f"(families {', '.join(FAMILIES)})")  # fmt: skip


def _tie_heads(x: torch.Tensor, arch) -> torch.Tensor:
    """o_proj's input channels (query head, dim) given their KV head's mean, so one scale per v row."""
    kv, hd = arch.num_kv_heads, arch.head_dim
    return x.reshape(kv, -1, hd).mean(1, keepdim=True).expand(kv, x.numel() // (kv * hd), hd).reshape(-1)


def search_scale(weight: torch.Tensor, hessian: torch.Tensor, mean_abs: torch.Tensor, group_size: int,
                 alphas: tuple[float, ...] = ALPHAS) -> AwqScale:  # fmt: skip
    """The scale s = mean_abs^alpha (normalised) of the alpha in `alphas` whose rounding of
    `weight` [N, K] * s, per group with zero points, gives the least output error against the
    inputs' `hessian` [K, K] (X^T X)."""
    from llmserve.model.w4a16_checkpoint import quantize_groups
    from llmserve.model.w4a16_gptq import dequantized

    w = weight.detach().to(torch.float32)
    h = hessian.to(w.device, torch.float32)
    x = mean_abs.to(w.device, torch.float32)
    best = None
    rtn = None
    for alpha in alphas:
        s = x.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        d = dequantized(*quantize_groups(w * s, group_size, False)) / s - w
        err = float(((d @ h) * d).sum())
        if alpha == 0:
            rtn = err
        if best is None or err < best[2]:
            best = (s, alpha, err)
    return AwqScale(best[0].cpu(), best[1], best[2], rtn if rtn is not None else float("nan"))


def awq_scales(source: Path, arch, calib: AwqCalibration, group_size: int) -> dict[str, AwqScale]:
    """Each fused projection's (`model.layers.N.self_attn.qkv_proj`, ...) activation-aware scale,
    searched on `calib`'s text on the float model as llmserve runs it (float32)."""
    from llmserve.model.attention import reference_paged_attention
    from llmserve.model.gptq_calibration import calibration_windows, gptq_model, projections, read_calibration_texts
    from llmserve.model.loader import load_model
    from llmserve.tokenizer import load_tokenizer

    _check_family(arch)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if calib.device == "auto" else calib.device
    windows = calibration_windows(read_calibration_texts(list(calib.texts), load_tokenizer(str(source))),
                                  calib.window, calib.tokens)  # fmt: skip
    model = load_model(str(source), arch, torch.float32, device, reference_paged_attention, progress=False,
                       max_positions=calib.window)  # fmt: skip
    mods = projections(model)
    found: dict[str, AwqScale] = {}
    started = time.perf_counter()

    def on_layer(report, _done) -> None:
        prefix = f"model.layers.{report.layer}."
        for name, hessian in report.hessians.items():
            path = name.removeprefix(prefix)
            if path not in ABSORBED_BY:
                continue
            x = report.mean_abs[name]
            if path == "self_attn.o_proj":
                x = _tie_heads(x, arch)
            found[name] = search_scale(mods[name].weight, hessian, x, group_size, calib.alphas)
        chosen = ", ".join(f"{n.removeprefix(prefix).split('.')[-1]} {s.alpha:.2f}" for n, s in found.items()
                           if n.startswith(prefix))  # fmt: skip
        print(f"AWQ scales: layer {report.layer + 1}/{arch.num_layers} (alpha: {chosen}; "
              f"{time.perf_counter() - started:.0f} s in all)", flush=True)  # fmt: skip

    print(f"AWQ scales: {len(windows)} calibration windows of {calib.window} tokens, on {device}", flush=True)
    gptq_model(model, windows, sequential=False, on_layer=on_layer, round_weight=lambda w, _h: (None, w))
    return found


def fold_scales(tensors: dict[str, torch.Tensor], scales: dict[str, AwqScale | torch.Tensor], arch) -> None:
    """In place on a checkpoint's float tensors (Hugging Face names): each fused projection's
    parts' input columns times s, 1/s into the op before (`ABSORBED_BY`). The float function is
    unchanged."""
    from llmserve.model.fp8 import projection_parts

    _check_family(arch)
    parts = projection_parts(arch)

    def update(name: str, change) -> None:
        t = tensors[name]
        tensors[name] = change(t.to(torch.float32)).to(t.dtype).contiguous()

    for name, found in scales.items():
        s = (found.scale if isinstance(found, AwqScale) else found).to(torch.float32)
        prefix, _, rest = name.partition(".layers.")
        layer, _, path = rest.partition(".")
        base = f"{prefix}.layers.{layer}."
        for part in parts[name]:
            update(f"{part}.weight", lambda w: w * s)
        kind, absorber = ABSORBED_BY[path]
        if kind == "norm":
            update(f"{base}{absorber}.weight", lambda w: w / s)
            continue
        rows = s
        if path == "self_attn.o_proj":  # one scale per v row: the heads of a KV group share it (_tie_heads)
            per = s.reshape(arch.num_kv_heads, -1, arch.head_dim)
            if not torch.equal(per, per[:, :1].expand_as(per)):
                raise ValueError(f"{name}: o_proj's scales differ within a KV group; v_proj cannot absorb them")
            rows = per[:, 0].reshape(-1)
        update(f"{base}{absorber}.weight", lambda w: w / rows[:, None])
        if f"{base}{absorber}.bias" in tensors:
            update(f"{base}{absorber}.bias", lambda b: b / rows)
