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
Either may leave projections in 16 bits (`ignore` / `ignored_layers` /
`modules_to_not_convert`: module names, or `re:` and a regular expression): they run unquantized,
as `--quantization-ignore` runs them. A fused projection's parts (q/k/v, gate/up) must be
left together or not at all.
Anything else (block-wise scales, integer or 4-bit types, a fused projection partly left in 16
bits, dynamic or per-head KV scales) is refused at start with the reason. `write_fp8_checkpoint`
writes every variant from a Hugging Face folder or a GGUF file (round to nearest, or GPTQ on
calibration text), for the tests (no download) and for users.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.model.arch import UnsupportedModelError
from llmserve.model.gptq_calibration import GptqOptions

FORMATS = ("fp8", "compressed-tensors")
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    format: str  # fp8 | compressed-tensors
    weights: str  # tensor | channel: how the checkpoint's weight scales are laid out
    activations: str  # dynamic | static
    ignore: tuple[str, ...] = ()  # projections left unquantized, by this model's (fused) module names
    block_shape: tuple[int, int] | None = None  # weights "block": each scale's (rows, columns) block

    @property
    def method(self) -> str:
        """The engine's quantization (model/quantized_checkpoint.py)."""
        return "fp8"


def _refuse(why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported quantization_config: {why}")


def _kept_projections(ignored: object, cfg: dict) -> tuple[str, ...]:
    """The model's projections a checkpoint's ignore list leaves in 16 bits (entries naming
    the LM head are allowed: it is never quantized here; entries naming nothing of this
    model, an MoE router say, are logged)."""
    from llmserve.model.arch import parse_model_arch
    from llmserve.model.fp8 import is_ignored, projection_parts

    def listed(name: str, patterns: tuple[str, ...]) -> bool:  # matched from the name's start
        return is_ignored(name, patterns, whole=False)

    if not isinstance(ignored, list) or not all(isinstance(p, str) for p in ignored):
        raise _refuse(f"the ignore list {ignored!r} is not a list of module names")
    patterns = tuple(ignored)
    num_layers = int(cfg.get("num_hidden_layers") or 0)
    if num_layers <= 0 and any(not listed("lm_head", (p,)) for p in patterns):
        raise _refuse("an ignore list in a config.json without num_hidden_layers")
    groups = list(projection_parts(parse_model_arch(cfg)).items()) if patterns and num_layers > 0 else []
    kept = []
    try:
        unused = [p for p in patterns if not listed("lm_head", (p,))
                  and not any(listed(n, (p,)) for _, parts in groups for n in parts)]  # fmt: skip
        if unused:
            logger.warning("the checkpoint's ignore list names nothing in this model: %s", ", ".join(unused))
        for fused, parts in groups:
            left = [p for p in parts if listed(p, patterns)]
            if left and len(left) < len(parts):
                raise _refuse(f"{', '.join(left)} left unquantized without {', '.join(p for p in parts if p not in left)} "
                              f"(llmserve runs them as one projection, {fused.rsplit('.', 1)[-1]})")  # fmt: skip
            if left:
                kept.append(fused)
    except re.error as e:
        raise _refuse(f"a bad regular expression in the ignore list ({e})") from None
    return tuple(kept)


def _block_shape(qc: dict, cfg: dict, scheme: str) -> tuple[int, int] | None:
    """`weight_block_size` (a scale per block, `weight_scale_inv`): read for mixtures of experts
    (model/moe_block.py keeps the experts' blocks; model/fp8_blocks.py) with dynamic activations."""
    block = qc.get("weight_block_size")
    if not block:
        return None
    from llmserve.model.arch import parse_model_arch
    from llmserve.model.interface import is_moe
    from llmserve.model.moe_block import fp8_block_shape

    if not is_moe(parse_model_arch(cfg)):
        raise _refuse(f"block-wise FP8 scales (weight_block_size {block}) on a dense model (read for mixtures of "
                      "experts: Qwen3-MoE, Qwen2-MoE, Mixtral)")  # fmt: skip
    if scheme != "dynamic":
        raise _refuse("block-wise FP8 scales with static activation scales (dynamic is read)")
    return fp8_block_shape(cfg)


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
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _refuse(f"activation_scheme {scheme!r}")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _refuse(f"fmt {qc['fmt']!r} (e4m3 is read)")
        block = _block_shape(qc, cfg, scheme)
        kept = _kept_projections(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [], cfg)
        return CheckpointQuantization("fp8", "block" if block else "tensor", scheme, kept, block)
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
        kept = _kept_projections(qc.get("ignore") or [], cfg)
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
        return CheckpointQuantization("compressed-tensors", weights["strategy"], activations, kept)
    raise _refuse(f"quant_method {method!r} (fp8 and compressed-tensors FP8 are read)")


def _config_entry(fmt: str, weights: str, activations: str, kept: list[str] = (),
                  block_shape: tuple[int, int] = (128, 128)) -> dict:  # fmt: skip
    ignore = ["lm_head", *kept]
    if fmt == "fp8" and weights == "block":  # as Qwen3-30B-A3B-FP8 publishes it
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": activations,
                "weight_block_size": list(block_shape), "ignored_layers": ignore}  # fmt: skip
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": activations, "ignored_layers": ignore}
    acts = ({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
            if activations == "dynamic" else
            {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True})  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ignore, "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": acts,
                "weights": {"num_bits": 8, "type": "float", "strategy": weights, "dynamic": False, "symmetric": True}}}}  # fmt: skip


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_model(source: Path):
    """The source as transformers loads it (float32): a Hugging Face folder or a GGUF file."""
    from transformers import AutoModelForCausalLM

    if source.is_file():
        return AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


def _calibrate(model_dir: Path, prompts: list[list[int]]) -> tuple[dict[str, float], dict[int, tuple[float, float]]]:
    """Static activation scales (the largest |input| each projection sees over `prompts`,
    / 448, by module name) and KV cache scales by layer (the largest |key| and |value| as the
    cache holds them, after any q/k norm and the rotary embedding, mapped as
    model/kv_scales.py maps them: x HEADROOM / 448)."""
    from transformers import DynamicCache

    from llmserve.model.fp8 import FP8_MAX
    from llmserve.model.kv_scales import scales_from_amax

    model = _hf_model(model_dir)
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


@dataclass(frozen=True, slots=True)
class GptqCalibration:
    """`make-fp8-checkpoint --gptq`: the weights rounded by GPTQ (model/gptq_calibration.py)
    on windows of these UTF-8 texts, round robin, `tokens` in all."""

    texts: tuple[str, ...]
    tokens: int = 8192
    window: int = 512
    options: GptqOptions = GptqOptions()
    device: str = "auto"  # cuda when there is one


def _gptq_rounded(
    source: Path, arch, gptq: GptqCalibration, kept: tuple[str, ...]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(FP8 weight, row scales) by checkpoint tensor name (`...q_proj.weight`) for every
    projection not `kept`, GPTQ-rounded on the model as llmserve runs it (float32 on a CPU,
    bfloat16 on a GPU)."""
    from llmserve.model.attention import reference_paged_attention
    from llmserve.model.fp8 import projection_parts
    from llmserve.model.gptq_calibration import calibration_windows, gptq_model, read_calibration_texts
    from llmserve.model.llama import LlamaForCausalLM
    from llmserve.model.loader import load_model
    from llmserve.tokenizer import load_tokenizer

    device = ("cuda" if torch.cuda.is_available() else "cpu") if gptq.device == "auto" else gptq.device
    windows = calibration_windows(read_calibration_texts(list(gptq.texts), load_tokenizer(str(source))),
                                  gptq.window, gptq.tokens)  # fmt: skip
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = load_model(str(source), arch, dtype, device, reference_paged_attention, progress=False,
                       max_positions=gptq.window)  # fmt: skip
    layers = arch.num_layers
    started = time.perf_counter()

    def progress(report, _done) -> None:
        print(f"GPTQ: layer {report.layer + 1}/{layers} rounded ({report.seconds:.1f} s, "
              f"{time.perf_counter() - started:.0f} s in all)", flush=True)  # fmt: skip

    print(f"GPTQ: {len(windows)} calibration windows of {gptq.window} tokens from {len(gptq.texts)} text(s), on {device}",
          flush=True)  # fmt: skip
    fused = gptq_model(model, windows, set(kept), gptq.options, on_layer=progress)
    parts = projection_parts(arch)
    out = {}
    for name, (q, scale) in fused.items():
        for part in parts[name]:
            target, shard = LlamaForCausalLM._target(part + ".weight")
            if shard is None:
                out[part + ".weight"] = (q.cpu(), scale.cpu())
            else:
                out[part + ".weight"] = (model._shard_view(target, q, shard).cpu().clone(),
                                         model._shard_view(target, scale, shard).cpu().clone())  # fmt: skip
    return out


def write_fp8_checkpoint(model_dir: str | Path, out_dir: str | Path, fmt: str = "fp8", weights: str = "tensor",
                         activations: str = "dynamic", calibration: list[list[int]] | None = None,
                         kv_scales: bool = False, ignore: tuple[str, ...] = (),
                         gptq: GptqCalibration | None = None, block_shape: tuple[int, int] = (128, 128)) -> Path:  # fmt: skip
    """Quantize a model's projections to FP8 and write them as a Hugging Face folder in `fmt`
    ("fp8": per-tensor weight scales, or with `weights` "block" one per `block_shape` block,
    `weight_scale_inv`, for a mixture of experts; "compressed-tensors": per `weights` "tensor" or
    "channel"), with `activations` "dynamic" or "static" (scales calibrated on
    `calibration`, token-id prompts; default: a few fixed ones). The source is a Hugging Face
    folder (safetensors) or a GGUF file (its weights dequantized and written in bfloat16, its
    config and tokenizer as Hugging Face files). `kv_scales`: each layer's
    `self_attn.k_scale` / `v_scale` for an FP8 KV cache, calibrated the same way. `ignore`:
    projections left in 16 bits (this model's module names or `re:` patterns, as
    `--quantization-ignore` takes them; listed in the config's ignore list by checkpoint
    name). `gptq`: the weights rounded by GPTQ on calibration text instead of to nearest
    (per-channel scales)."""
    from safetensors.torch import save_file

    from llmserve.config import read_arch
    from llmserve.model.fp8 import is_ignored, projection_names, projection_parts, quantize_rows, unmatched_patterns
    from llmserve.model.fp8_blocks import quantize_blocks
    from llmserve.model.loader import _checkpoint_tensors

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}")
    if weights not in {"fp8": ("tensor", "block"), "compressed-tensors": ("tensor", "channel")}[fmt]:
        raise ValueError("weights: tensor (either format), channel (compressed-tensors) or block (fp8)")
    if weights == "block" and activations != "dynamic":
        raise ValueError("block-wise weight scales go with dynamic activations")
    if activations not in ("dynamic", "static"):
        raise ValueError("activations: dynamic or static")
    if isinstance(ignore, str):
        raise ValueError("ignore: a tuple of names or patterns, not one string")
    if gptq is not None and weights != "channel":
        raise ValueError("GPTQ rounds onto a scale per output channel: weights channel (compressed-tensors)")
    source, out = Path(model_dir), Path(out_dir)
    if not source.is_file() and not (source / "config.json").is_file():
        raise ValueError(f"{str(source)!r} is not a Hugging Face model folder (no config.json) nor a GGUF file: an FP8 "
                         "checkpoint is written from one")  # fmt: skip
    cfg = _source_config(source)
    if read_checkpoint_quantization(cfg) is not None:
        raise ValueError(f"{str(source)!r} is already an FP8 checkpoint: write one from its bf16/fp16 source")
    if source.is_file() and (activations == "static" or kv_scales):
        raise ValueError("static input scales and KV cache scales are calibrated through transformers from a Hugging "
                         "Face folder, not a GGUF file (dynamic activations are; the engine calibrates KV scales at start)")  # fmt: skip
    arch = read_arch(source, own_tokenizer=source.is_file())
    try:
        unmatched = unmatched_patterns(tuple(ignore), arch)
    except re.error as e:
        raise ValueError(f"ignore: a bad regular expression ({e})") from None
    if unmatched:
        raise ValueError(f"ignore: {', '.join(unmatched)} names no projection of this model")
    kept = tuple(n for n in projection_names(arch) if is_ignored(n, tuple(ignore)))
    parts = projection_parts(arch)
    kept_parts = [part for n in kept for part in parts[n]]
    input_scales: dict[str, float] = {}
    kv: dict[int, tuple[float, float]] = {}
    if activations == "static" or kv_scales:
        input_scales, kv = _calibrate(source, calibration or [[1, *range(5 + i, 60 + 7 * i)] for i in range(4)])
        input_scales = input_scales if activations == "static" else {}
    rounded = _gptq_rounded(source, arch, gptq, kept) if gptq is not None else {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in _checkpoint_tensors(source, arch, progress=True):
        module = name.removesuffix(".weight")
        quantize = name.endswith(".weight") and module.split(".")[-1] in _PROJECTIONS and module not in kept_parts
        if quantize and weights == "block":
            tensors[name], tensors[module + ".weight_scale_inv"] = quantize_blocks(tensor, block_shape)
        elif quantize:
            q, scale = rounded.get(name) or quantize_rows(tensor, per_channel=weights == "channel")
            tensors[name] = q
            tensors[module + ".weight_scale"] = scale[:1, 0].clone() if weights == "tensor" else scale
            if module in input_scales:
                tensors[module + ".input_scale"] = torch.tensor([input_scales[module]], dtype=torch.float32)
        elif source.is_file():  # a GGUF's weights, dequantized to float32
            tensors[name] = tensor.to(torch.bfloat16).contiguous()
        else:
            tensors[name] = tensor
    for layer, (k_scale, v_scale) in (kv if kv_scales else {}).items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale, dtype=torch.float32)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused setting leaves nothing behind
    save_file(tensors, str(out / "model.safetensors"))
    cfg["quantization_config"] = _config_entry(fmt, weights, activations, kept_parts, block_shape)
    if kv_scales:
        cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                         "dynamic": False, "symmetric": True}  # fmt: skip
    if gptq is not None:  # how the weights were rounded (read by nothing; for people)
        cfg["quantization_config"]["llmserve_rounding"] = {"method": "gptq", "calibration_texts": [Path(t).name for t in gptq.texts],
                                                           "calibration_tokens": gptq.tokens, "window": gptq.window,
                                                           "damp": gptq.options.damp}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(source, out)
    return out


def _source_config(source: Path) -> dict:
    if not source.is_file():
        return json.loads((source / "config.json").read_text())
    from llmserve.model.gguf.checkpoint import open_gguf
    from llmserve.model.gguf.config import gguf_hf_config

    return {**gguf_hf_config(open_gguf(source)), "torch_dtype": "bfloat16"}


def _copy_tokenizer(source: Path, out: Path) -> None:
    """The tokenizer and generation settings: a folder's files as they are; a GGUF's
    tokenizer (with its chat template) written by transformers."""
    if source.is_file():
        from llmserve.tokenizer import load_tokenizer

        load_tokenizer(str(source)).save_pretrained(out)
        return
    for extra in source.iterdir():
        if (
            extra.is_file()
            and extra.suffix != ".safetensors"
            and extra.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy(extra, out / extra.name)
