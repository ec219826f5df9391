"""FP8 checkpoints as they are published: what their config says, and writing them.

Two formats are read (both: FP8 E4M3 weights of the linear layers, the LM head and the
embedding left in 16 bits):
- `quant_method: "fp8"` (AutoFP8, vLLM): `weight_scale` per tensor; `activation_scheme`
  "dynamic" (activations quantized per token at run time) or "static" (`input_scale`
  per tensor, calibrated);
- `quant_method: "compressed-tensors"` (llm-compressor), format `float-quantized`: weights
  with a `weight_scale` per tensor or per output channel; input activations dynamic per
  token, static per tensor (`input_scale`), or none listed (then dynamic per token).
Either may carry an FP8 KV cache's scales (`kv_cache_scheme`: 8-bit float, one static scale
per layer for keys and one for values: `self_attn.k_scale` / `v_scale`, read by
model/kv_scales.py and used with `--kv-cache-dtype fp8`).
Anything else (block-wise scales, integer or 4-bit types, per-layer exceptions other than
the LM head, dynamic or per-head KV scales) is refused at start with the reason. `write_fp8_checkpoint` writes every
variant from a Hugging Face folder, for the tests (no download) and for users.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.model.arch import UnsupportedModelError

FORMATS = ("fp8", "compressed-tensors")


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    format: str  # fp8 | compressed-tensors
    weights: str  # tensor | channel: how the checkpoint's weight scales are laid out
    activations: str  # dynamic | static


def _refuse(why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported quantization_config: {why}")


def _only_lm_head(ignored: list) -> bool:
    return all(isinstance(name, str) and name.removeprefix("re:").lstrip(".*").endswith("lm_head") for name in ignored)


def read_checkpoint_quantization(cfg: dict) -> CheckpointQuantization | None:
    """The FP8 format a config.json's `quantization_config` describes (None: not quantized)."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    kv = qc.get("kv_cache_scheme")
    if kv:
        if kv.get("type") != "float" or kv.get("num_bits") != 8:
            raise _refuse(f"a KV cache of {kv.get('num_bits')}-bit {kv.get('type')} (8-bit float is read)")
        if kv.get("dynamic") or kv.get("strategy", "tensor") != "tensor":
            raise _refuse(f"KV cache scales {'dynamic' if kv.get('dynamic') else kv.get('strategy')!r} "
                          "(one static scale per layer is read)")  # fmt: skip
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise _refuse(f"block-wise FP8 scales (weight_block_size {qc['weight_block_size']})")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _refuse(f"activation_scheme {scheme!r}")
        if not _only_lm_head(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []):
            raise _refuse("layers left unquantized other than the LM head")
        return CheckpointQuantization("fp8", "tensor", scheme)
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise _refuse(f"compressed-tensors format {fmt!r} (float-quantized is read)")
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise _refuse(f"{len(groups)} compressed-tensors config groups (one is read)")
        weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _refuse(f"weights of {weights.get('num_bits')}-bit {weights.get('type')} (8-bit float is read)")
        if weights.get("strategy") not in ("tensor", "channel"):
            raise _refuse(f"weight strategy {weights.get('strategy')!r} (tensor and channel are read)")
        if not _only_lm_head(qc.get("ignore") or []):
            raise _refuse("layers left unquantized other than the LM head")
        activations = "dynamic"
        if acts:
            if acts.get("type") != "float" or acts.get("num_bits") != 8:
                raise _refuse(f"input activations of {acts.get('num_bits')}-bit {acts.get('type')}")
            if acts.get("dynamic"):
                if acts.get("strategy") not in ("token", "tensor"):
                    raise _refuse(f"dynamic activation strategy {acts.get('strategy')!r}")
            elif acts.get("strategy") == "tensor":
                activations = "static"
            else:
                raise _refuse(f"static activation strategy {acts.get('strategy')!r} (tensor is read)")
        return CheckpointQuantization("compressed-tensors", weights["strategy"], activations)
    raise _refuse(f"quant_method {method!r} (fp8 and compressed-tensors FP8 are read)")


def _config_entry(fmt: str, weights: str, activations: str) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": activations, "ignored_layers": ["lm_head"]}
    acts = ({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
            if activations == "dynamic" else
            {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True})  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": acts,
                "weights": {"num_bits": 8, "type": "float", "strategy": weights, "dynamic": False, "symmetric": True}}}}  # fmt: skip


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _calibrate(model_dir: Path, prompts: list[list[int]]) -> tuple[dict[str, float], dict[int, tuple[float, float]]]:
    """Static activation scales (the largest |input| each projection sees over `prompts`,
    / 448, by module name) and KV cache scales by layer (the largest |key| and |value| as the
    cache holds them, after any q/k norm and the rotary embedding, mapped as
    model/kv_scales.py maps them: x HEADROOM / 448)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from llmserve.model.fp8 import FP8_MAX
    from llmserve.model.kv_scales import scales_from_amax

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    kv_amax: dict[int, tuple[float, float]] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.split(".")[-1] in _PROJECTIONS:
            def hook(_m, args, _out, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for ids in prompts:
            cache = DynamicCache()
            update = cache.update

            def recording_update(key, value, layer_idx, *args, update=update, **kwargs):  # what the cache stores
                k, v = kv_amax.get(layer_idx, (0.0, 0.0))
                kv_amax[layer_idx] = (max(k, float(key.abs().max())), max(v, float(value.abs().max())))
                return update(key, value, layer_idx, *args, **kwargs)

            cache.update = recording_update
            model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    for h in hooks:
        h.remove()
    layers = sorted(kv_amax)
    kv = dict(zip(layers, scales_from_amax([kv_amax[i] for i in layers])))
    return {name: value / FP8_MAX for name, value in amax.items()}, kv


def write_fp8_checkpoint(model_dir: str | Path, out_dir: str | Path, fmt: str = "fp8", weights: str = "tensor",
                         activations: str = "dynamic", calibration: list[list[int]] | None = None,
                         kv_scales: bool = False) -> Path:  # fmt: skip
    """Quantize a Hugging Face folder's projections to FP8 and write them in `fmt`
    ("fp8": per-tensor weight scales; "compressed-tensors": per `weights` "tensor" or
    "channel"), with `activations` "dynamic" or "static" (scales calibrated on
    `calibration`, token-id prompts; default: a few fixed ones). `kv_scales`: each layer's
    `self_attn.k_scale` / `v_scale` for an FP8 KV cache, calibrated the same way."""
    from safetensors.torch import load_file, save_file

    from llmserve.model.fp8 import quantize_rows
    from llmserve.model.loader import safetensors_files

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}")
    if weights not in ("tensor", "channel") or (fmt == "fp8" and weights != "tensor"):
        raise ValueError("weights: tensor (either format) or channel (compressed-tensors)")
    if activations not in ("dynamic", "static"):
        raise ValueError("activations: dynamic or static")
    model_dir, out = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{str(model_dir)!r} is not a Hugging Face model folder (no config.json): an FP8 "
                         "checkpoint is written from one (safetensors weights)")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    input_scales: dict[str, float] = {}
    kv: dict[int, tuple[float, float]] = {}
    if activations == "static" or kv_scales:
        input_scales, kv = _calibrate(model_dir, calibration or [[1, *range(5 + i, 60 + 7 * i)] for i in range(4)])
        input_scales = input_scales if activations == "static" else {}
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        for name, tensor in load_file(str(path)).items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.split(".")[-1] in _PROJECTIONS:
                q, scale = quantize_rows(tensor, per_channel=weights == "channel")
                tensors[name] = q
                tensors[module + ".weight_scale"] = scale[:1, 0].clone() if weights == "tensor" else scale
                if module in input_scales:
                    tensors[module + ".input_scale"] = torch.tensor([input_scales[module]], dtype=torch.float32)
            else:
                tensors[name] = tensor
    for layer, (k_scale, v_scale) in (kv if kv_scales else {}).items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale, dtype=torch.float32)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale, dtype=torch.float32)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = _config_entry(fmt, weights, activations)
    if kv_scales:
        cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                         "dynamic": False, "symmetric": True}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in model_dir.iterdir():  # tokenizer and generation settings
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(extra, out / extra.name)
    return out
