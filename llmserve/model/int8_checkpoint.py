"""W8A8 INT8 checkpoints as llm-compressor publishes them, and writing them.

Read: `quant_method: "compressed-tensors"`, format `int-quantized`, one config group whose
weights are 8-bit `int`, symmetric, `strategy` channel (`weight_scale` [out, 1]) or tensor (one
scale), and whose input activations are 8-bit int, symmetric, dynamic per token, or static per
tensor (`input_scale`), or not listed (dynamic per token). The projections' weights are loaded
as they are (int8) with their scales; the LM head and the embedding stay in 16 bits. The ignore
list is read as for FP8 checkpoints (model/fp8_checkpoint.py). Refused at start, with the reason:
asymmetric weights or activations (zero points), group or block strategies, other bit widths.

`write_int8_checkpoint` writes one from a Hugging Face folder or a GGUF file (`llmserve
make-int8-checkpoint`): weights rounded to nearest per output channel, optionally after a
SmoothQuant migration (Xiao et al., 2022: each input channel's activation range divided by
s_j = max|X_j|^a / max|W_j|^(1-a), measured on calibration prompts, and the weights' columns
multiplied by it; the division goes into the RMSNorm before q/k/v and gate/up, so the float
model is unchanged and the activations are easier to quantize per token).
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.model.arch import UnsupportedModelError
from llmserve.model.int8 import INT8_MAX

FORMAT = "int-quantized"
# `make-int8-checkpoint --int8-embedding`: the quantization_config key that says the embedding is int8
# (`model.embed_tokens.weight` int8 and `model.embed_tokens.weight_scale` [vocab, 1]); compressed-tensors
# has no such form, so only llmserve reads these checkpoints' embedding
EMBEDDING_KEY = "llmserve_int8_embedding"


@dataclass(frozen=True, slots=True)
class Int8Checkpoint:
    weights: str  # channel | tensor: how the checkpoint's weight scales are laid out
    activations: str  # dynamic | static
    ignore: tuple[str, ...] = ()  # projections left unquantized, by this model's (fused) module names
    format: str = "compressed-tensors"
    embedding: bool = False  # the embedding's rows in int8 with a scale each (llmserve's own key: EMBEDDING_KEY)

    @property
    def method(self) -> str:
        """The engine's quantization: every projection not ignored is an `Int8Linear`."""
        return "int8"


def _refuse(why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported quantization_config: {why}")


def is_int8_config(qc: dict) -> bool:
    """A compressed-tensors config whose weights are 8-bit integers (the one group read here)."""
    if qc.get("quant_method") != "compressed-tensors":
        return False
    groups = list((qc.get("config_groups") or {}).values())
    weights = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
    return weights.get("type") == "int" and weights.get("num_bits") == 8


def read_int8_quantization(cfg: dict) -> Int8Checkpoint:
    """The W8A8 layout a compressed-tensors int8 `quantization_config` describes (`is_int8_config`)."""
    from llmserve.model.fp8_checkpoint import _kept_projections

    qc = cfg["quantization_config"]
    if qc.get("format") != FORMAT:
        raise _refuse(f"compressed-tensors format {qc.get('format')!r} for int8 weights ({FORMAT} is read)")
    if qc.get("kv_cache_scheme"):
        raise _refuse("a kv_cache_scheme in an int8 checkpoint (FP8 checkpoints carry KV scales)")
    group = next(iter(qc["config_groups"].values()))
    weights, acts = group["weights"], group.get("input_activations")
    if not weights.get("symmetric", True):
        raise _refuse("asymmetric int8 weights (zero points; symmetric are read)")
    if weights.get("strategy") not in ("tensor", "channel"):
        raise _refuse(f"int8 weight strategy {weights.get('strategy')!r} (tensor and channel are read)")
    if weights.get("dynamic"):
        raise _refuse("dynamic weight scales")
    activations = "dynamic"
    if acts:
        if acts.get("type") != "int" or acts.get("num_bits") != 8:
            raise _refuse(f"input activations of {acts.get('num_bits')}-bit {acts.get('type')} with int8 weights")
        if not acts.get("symmetric", True):
            raise _refuse("asymmetric int8 activations (zero points; symmetric are read)")
        if acts.get("dynamic"):
            if acts.get("strategy") not in ("token", "tensor"):
                raise _refuse(f"dynamic activation strategy {acts.get('strategy')!r}")
        elif acts.get("strategy") == "tensor":
            activations = "static"
        else:
            raise _refuse(f"static activation strategy {acts.get('strategy')!r} (tensor is read)")
    kept = _kept_projections(qc.get("ignore") or [], cfg)
    return Int8Checkpoint(weights["strategy"], activations, kept, embedding=bool(qc.get(EMBEDDING_KEY)))


def config_entry(weights: str, activations: str, kept_parts: list[str]) -> dict:
    """The `quantization_config` of a W8A8 int8 checkpoint written here."""
    acts = ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
            if activations == "dynamic" else
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False})  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "ignore": ["lm_head", *kept_parts], "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": acts,
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": weights, "dynamic": False}}}}  # fmt: skip


# -- SmoothQuant ------------------------------------------------------------------------------

_SMOOTHED = {  # the norm before each group of projections that share its output (Llama's layer)
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(frozen=True, slots=True)
class SmoothQuant:
    """`make-int8-checkpoint --smoothquant ALPHA`: activation ranges measured on `prompts` (token
    ids; default: windows of `texts`, else a few fixed prompts) moved into the weights."""

    alpha: float = 0.5
    texts: tuple[str, ...] = ()
    tokens: int = 4096
    window: int = 512


def _input_amax(source: Path, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """The largest |input| of each input channel of every q/k/v and gate/up projection over
    `prompts`, by module name, through transformers (float32)."""
    from llmserve.model.fp8_checkpoint import _hf_model

    model = _hf_model(source)
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.endswith((".q_proj", ".gate_proj")):

            def hook(_m, args, _out, name=name):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0)
                amax[name] = x if name not in amax else torch.maximum(amax[name], x)

            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


def smooth_tensors(tensors: dict[str, torch.Tensor], amax: dict[str, torch.Tensor], alpha: float,
                   num_layers: int) -> None:  # fmt: skip
    """SmoothQuant in place on a Llama-family checkpoint's float tensors: per layer and norm,
    s_j = amax_x[j]^alpha / max_w[j]^(1 - alpha) over the projections that read the norm's output;
    the norm's weight / s, each projection's columns * s (the float product is unchanged)."""
    for layer in range(num_layers):
        for norm, projections in _SMOOTHED.items():
            prefix = f"model.layers.{layer}."
            names = [f"{prefix}{p}.weight" for p in projections]
            probe = f"{prefix}{projections[0]}"
            if probe not in amax or any(n not in tensors for n in names):
                continue  # a projection left in 16 bits (ignored) keeps its group unsmoothed
            w_max = torch.stack([tensors[n].float().abs().amax(dim=0) for n in names]).amax(dim=0)
            s = (amax[probe].clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
            norm_name = f"{prefix}{norm}.weight"
            tensors[norm_name] = (tensors[norm_name].float() / s).to(tensors[norm_name].dtype)
            for n in names:
                tensors[n] = (tensors[n].float() * s).to(tensors[n].dtype)


def _calibration_prompts(source: Path, smooth: SmoothQuant | None) -> list[list[int]]:
    if smooth is None or not smooth.texts:
        return [[1, *range(5 + i, 60 + 7 * i)] for i in range(4)]
    from llmserve.model.gptq_calibration import calibration_windows, read_calibration_texts
    from llmserve.tokenizer import load_tokenizer

    texts = read_calibration_texts(list(smooth.texts), load_tokenizer(str(source)))
    return [list(map(int, w)) for w in calibration_windows(texts, smooth.window, smooth.tokens)]


# -- writing ----------------------------------------------------------------------------------


def write_int8_checkpoint(model_dir: str | Path, out_dir: str | Path, activations: str = "dynamic",
                          ignore: tuple[str, ...] = (), smooth: SmoothQuant | None = None,
                          embedding: bool = False) -> Path:  # fmt: skip
    """Quantize a model's projections to int8 (a scale per output channel, round to nearest) and
    write them as a compressed-tensors W8A8 folder: activations "dynamic" (per token at run time)
    or "static" (a scale per tensor calibrated on a few prompts). `ignore`: projections left in 16
    bits (module names or `re:` patterns, as `--quantization-ignore`). `smooth`: SmoothQuant first
    (Llama-family folders: plain RMSNorm weights). `embedding`: the embedding's rows in int8 too, a
    float32 scale each (model/int8_embedding.py; a tied LM head reads them, an untied one stays)."""
    from safetensors.torch import save_file

    from llmserve.config import read_arch
    from llmserve.model.fp8 import is_ignored, projection_names, projection_parts, unmatched_patterns
    from llmserve.model.fp8_checkpoint import _PROJECTIONS, _calibrate, _copy_tokenizer, _source_config
    from llmserve.model.int8 import quantize_rows_int8
    from llmserve.model.loader import _checkpoint_tensors
    from llmserve.model.quantized_checkpoint import read_checkpoint_quantization

    if activations not in ("dynamic", "static"):
        raise ValueError("activations: dynamic or static")
    if isinstance(ignore, str):
        raise ValueError("ignore: a tuple of names or patterns, not one string")
    source, out = Path(model_dir), Path(out_dir)
    if not source.is_file() and not (source / "config.json").is_file():
        raise ValueError(f"{str(source)!r} is not a Hugging Face model folder (no config.json) nor a GGUF file: an int8 "
                         "checkpoint is written from one")  # fmt: skip
    cfg = _source_config(source)
    if read_checkpoint_quantization(cfg) is not None:
        raise ValueError(f"{str(source)!r} is already quantized: write an int8 checkpoint from its bf16/fp16 source")
    arch = read_arch(source, own_tokenizer=source.is_file())
    if smooth is not None and (arch.family not in ("llama", "mistral", "qwen2", "qwen3")):
        raise ValueError(f"SmoothQuant folds its scales into plain RMSNorm weights: {arch.architecture} is not read")
    if source.is_file() and (activations == "static" or smooth is not None):
        raise ValueError("static input scales and SmoothQuant calibrate through transformers from a Hugging Face "
                         "folder, not a GGUF file")  # fmt: skip
    try:
        unmatched = unmatched_patterns(tuple(ignore), arch)
    except re.error as e:
        raise ValueError(f"ignore: a bad regular expression ({e})") from None
    if unmatched:
        raise ValueError(f"ignore: {', '.join(unmatched)} names no projection of this model")
    kept = tuple(n for n in projection_names(arch) if is_ignored(n, tuple(ignore)))
    parts = projection_parts(arch)
    kept_parts = [part for n in kept for part in parts[n]]
    tensors = dict(_checkpoint_tensors(source, arch, progress=True))
    if source.is_file():  # a GGUF's weights, dequantized to float32: stored as bfloat16
        tensors = {n: t.to(torch.bfloat16).contiguous() for n, t in tensors.items()}
    prompts = _calibration_prompts(source, smooth)
    if smooth is not None:
        amax = _input_amax(source, prompts)
        smooth_tensors(tensors, {k: v for k, v in amax.items() if k not in kept_parts}, smooth.alpha, arch.num_layers)
    input_scales: dict[str, float] = {}
    if activations == "static":  # amax / 127 per projection (of the smoothed model: a folder transformers reads)
        from llmserve.model.fp8 import FP8_MAX

        with tempfile.TemporaryDirectory() as staging:
            calibrated = source
            if smooth is not None:
                calibrated = Path(staging)
                save_file(tensors, str(calibrated / "model.safetensors"))
                (calibrated / "config.json").write_text(json.dumps(cfg))
            fp8_scales, _ = _calibrate(calibrated, prompts)
        input_scales = {name: value * FP8_MAX / INT8_MAX for name, value in fp8_scales.items()}
    quantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".")[-1] in _PROJECTIONS and module not in kept_parts:
            q, scale = quantize_rows_int8(tensor)
            quantized[name] = q
            quantized[module + ".weight_scale"] = scale
            if module in input_scales:
                quantized[module + ".input_scale"] = torch.tensor([input_scales[module]], dtype=torch.float32)
        elif name == "model.embed_tokens.weight" and embedding:
            quantized[name], quantized["model.embed_tokens.weight_scale"] = quantize_rows_int8(tensor)
        else:
            quantized[name] = tensor
    out.mkdir(parents=True, exist_ok=True)
    save_file(quantized, str(out / "model.safetensors"))
    cfg["quantization_config"] = config_entry("channel", activations, kept_parts)
    if embedding:
        cfg["quantization_config"][EMBEDDING_KEY] = True
    if smooth is not None:  # how the weights were prepared (read by nothing; for people)
        cfg["quantization_config"]["llmserve_smoothquant"] = {"alpha": smooth.alpha, "prompts": len(prompts),
                                                              "texts": [Path(t).name for t in smooth.texts]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(source, out)
    return out
