"""An FP8 KV cache's scales: one key scale and one value scale per attention layer.

The cache stores key / k_scale and value / v_scale in E4M3 (saturating at +-448); the
attention kernels multiply them back (k_scale folds into the softmax scale, v_scale into the
output). E4M3 keeps 3 mantissa bits from 2^-6 to 448 and only subnormals below, so with scale
1 a layer whose values are small (SmolLM2's first layer: values under 0.6) stores many of them
with fewer bits. The scales come, in this order, from:

- the checkpoint: `k_scale` / `v_scale` beside a layer's attention (vLLM's and llm-compressor's
  `kv_cache_scheme`), `k_proj.output_scale` / `v_proj.output_scale` (compressed-tensors'
  older names), or one `kv_scale` for both (AutoFP8's); one number per layer;
- calibration at start (`--calculate-kv-scales`, on by default when the checkpoint has none):
  one forward pass over CALIBRATION_TOKENS seeded random token ids, the largest |key| and
  |value| of each layer, times HEADROOM, mapped to 448. Random ids give maxima within 0.6-1.5x
  of those of real text on SmolLM2 (docs/models.md), inside the headroom;
- 1 (`--no-calculate-kv-scales`: what an FP8 cache without scales does in vLLM).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmserve.attention_metadata import FP8_KV_MAX

HEADROOM = 2.0  # calibrated maxima map to 448 / HEADROOM: inputs up to 2x larger still fit
CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0
MIN_SCALE = 1e-30  # a smaller one's inverse overflows float32 in the cache-write kernel

# model.layers.N.self_attn.{k_scale, v_scale, kv_scale, attn.k_scale, k_proj.output_scale, ...}
_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale|k_proj\.output_scale"
                   r"|v_proj\.output_scale)$")  # fmt: skip


@dataclass(frozen=True, slots=True)
class KVScales:
    """Each layer's (k_scale, v_scale) and where they came from (checkpoint | calibrated | one)."""

    source: str
    scales: tuple[tuple[float, float], ...]

    def summary(self) -> str:
        if not self.scales:
            return self.source
        ks, vs = [s[0] for s in self.scales], [s[1] for s in self.scales]
        return f"{self.source}: k {min(ks):.3g}-{max(ks):.3g}, v {min(vs):.3g}-{max(vs):.3g}"

    def label(self) -> str | None:
        """What the bench JSON records: the summary, or None without an FP8 cache."""
        return self.summary() if self.scales else None


def checkpoint_scale_target(name: str) -> tuple[int, str] | None:
    """(layer index, "k" | "v" | "kv") for a checkpoint tensor that is a KV cache scale."""
    m = _NAME.match(name)
    if m is None:
        return None
    which = m.group(2)
    return int(m.group(1)), "kv" if which == "kv_scale" else which[0]


def checkpoint_scale_value(name: str, tensor: torch.Tensor) -> float:
    """The one number a KV scale tensor holds (per-head scales are refused)."""
    if tensor.numel() != 1:
        raise ValueError(f"{name}: {tuple(tensor.shape)} KV cache scales (one per layer is read, not per head)")
    value = float(tensor.reshape(()).float())
    if not MIN_SCALE <= value < float("inf"):
        raise ValueError(f"{name}: KV cache scale {value} (must be positive and finite, at least {MIN_SCALE:g})")
    return value


def scales_from_amax(amax: list[tuple[float, float]], headroom: float = HEADROOM) -> tuple[tuple[float, float], ...]:
    """Scales that map each layer's largest |key| and |value| to 448 / headroom (1 where 0)."""
    return tuple(tuple(a * headroom / FP8_KV_MAX if a > 0.0 else 1.0 for a in pair) for pair in amax)  # type: ignore[misc]


def calibration_length(max_num_batched_tokens: int, max_model_len: int, cache_tokens: int | None = None) -> int:
    """How many tokens the calibration prompt has: CALIBRATION_TOKENS, or fewer where one step,
    one sequence or the cache holds fewer."""
    return min(CALIBRATION_TOKENS, max_num_batched_tokens, max_model_len, cache_tokens or CALIBRATION_TOKENS)


def wants_calibration(calculate_kv_scales: bool | None, source: str) -> bool:
    """Whether an FP8 cache calibrates its scales: as asked, else when the checkpoint has none."""
    return calculate_kv_scales if calculate_kv_scales is not None else source != "checkpoint"


def calibration_token_ids(
    vocab_size: int, num_tokens: int = CALIBRATION_TOKENS, seed: int = CALIBRATION_SEED
) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=g).tolist()


def record_amax(model: torch.nn.Module, forward: Callable[[], None]) -> list[tuple[float, float]]:
    """Each attention layer's largest |key| and |value| over what `forward` runs (the layers'
    attention backends wrapped for the call, then restored). An FP8 cache is not read: the
    layers attend over a scratch cache in the queries' dtype holding just the blocks the
    forward uses, so the maxima are the unquantized model's (as a checkpoint's calibration)."""
    layers = model.attention_layers()
    maxima: list[torch.Tensor | None] = [None] * len(layers)

    def recorder(i: int, backend):
        def call(q, k, v, kv_cache, meta, scale, **kwargs):
            pair = torch.stack([k.detach().abs().amax().float(), v.detach().abs().amax().float()])
            maxima[i] = pair if maxima[i] is None else torch.maximum(maxima[i], pair)
            if kv_cache.dtype != q.dtype:  # e.g. FP8: attend over the exact keys and values instead
                used = -(-meta.max_seq_len // kv_cache.shape[2])  # the table's columns in use (the rest may be stale)
                blocks = int(meta.block_tables[:, :used].max()) + 1
                kv_cache = torch.zeros((2, blocks, *kv_cache.shape[2:]), dtype=q.dtype, device=q.device)
                kwargs["kv_scales"] = (1.0, 1.0)
            return backend(q, k, v, kv_cache, meta, scale, **kwargs)

        return call

    backends = [layer.backend for layer in layers]
    try:
        for i, layer in enumerate(layers):
            layer.backend = recorder(i, backends[i])
        forward()
    finally:
        for layer, backend in zip(layers, backends):
            layer.backend = backend
    return [(0.0, 0.0) if m is None else (float(m[0]), float(m[1])) for m in maxima]


def apply_scales(model: torch.nn.Module, scales: KVScales) -> None:
    layers = model.attention_layers()
    if len(scales.scales) != len(layers):
        raise ValueError(f"{len(scales.scales)} KV scale pairs for {len(layers)} layers")
    for layer, pair in zip(layers, scales.scales):
        layer.kv_scales = (float(pair[0]), float(pair[1]))


def current_scales(model: torch.nn.Module, source: str) -> KVScales:
    return KVScales(source, tuple(layer.kv_scales for layer in model.attention_layers()))


def calibrate(model: torch.nn.Module, forward: Callable[[list[int]], None], vocab_size: int,
              num_tokens: int = CALIBRATION_TOKENS) -> KVScales:  # fmt: skip
    """Calibrated scales, applied to the model: `forward(token_ids)` runs one prompt through it."""
    ids = calibration_token_ids(vocab_size, num_tokens)
    scales = KVScales("calibrated", scales_from_amax(record_amax(model, lambda: forward(ids))))
    apply_scales(model, scales)
    return scales


def choose_scales(model: torch.nn.Module, calculate_kv_scales: bool | None, forward: Callable[[list[int]], None],
                  vocab_size: int, num_tokens: int) -> KVScales:  # fmt: skip
    """An FP8 cache's scales as the engine picks them: calibrated (`forward(token_ids)` runs one
    prompt of `num_tokens`) when asked, or by default when the checkpoint gives none; else the
    checkpoint's, else 1."""
    source = model.kv_scales_source
    if not wants_calibration(calculate_kv_scales, source):
        return current_scales(model, source)
    return calibrate(model, forward, vocab_size, num_tokens)
