"""Gemma 3 (text): `Gemma3ForCausalLM`, and the language model of `Gemma3ForConditionalGeneration`.

The Llama block with four differences, each as transformers computes it:
- attention: sliding-window layers (`layer_types`; five of every six by default) with their own
  rope base (`rope_local`), full layers with the global one; q/k RMSNorm per head; the scale
  `query_pre_attn_scalar ** -0.5`;
- norms: Gemma's RMSNorm multiplies by (1 + w) in float32; the weights are stored as 1 + w when
  they load, so the Llama norm (and its fused kernels) computes it;
- the layer: input norm -> attention -> post-attention norm -> + residual -> pre-feed-forward
  norm -> GeGLU MLP (tanh GELU) -> post-feed-forward norm -> + residual;
- the embedding is scaled by sqrt(hidden_size) (in the weights' dtype); the logits may be
  soft-capped (`final_logit_softcapping`).
The causal LM reuses the Llama family's attention, MLP, fused projections and checkpoint loading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from llmserve.model import llama
from llmserve.model.arch import FULL, SLIDING, ModelArch, UnsupportedModelError, eos_token_ids, parse_rope
from llmserve.model.attention import AttentionBackend
from llmserve.model.interface import ModelFamily
from llmserve.model.layers import LayerOps, RMSNorm, RotaryEmbedding
from llmserve.model.llama import (
    MLP,
    Attention,
    LlamaForCausalLM,
    attention_specs,
    gguf_name_mapper,
    linear_specs,
    takes_fp8_tokens,
)
from llmserve.model.tensor_parallel import TPGroup, VocabParallelEmbedding, local_arch

ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


class DecoderLayer(llama.DecoderLayer):
    """Llama's layer (its forward, sampled rows and the part before attention) with Gemma's norms
    around the attention output and the MLP."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, rotary: RotaryEmbedding, ops: LayerOps,
                 tp: TPGroup, quantization: str | None, window: int | None) -> None:  # fmt: skip
        nn.Module.__init__(self)
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, ops)
        self.self_attn = Attention(arch, backend, rotary, ops, tp, quantization, window)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, ops)
        self.mlp = MLP(arch, ops, tp, quantization)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, ops)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The post-attention norm, its sum with the residual normed for the MLP, the MLP and the
        post-feed-forward norm: (this layer's output before its residual add, the residual). The
        next layer's input norm (or the final norm) adds it to the residual."""
        h = self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        norm = self.pre_feedforward_layernorm
        x, residual = (norm.fp8 if takes_fp8_tokens(self.mlp.gate_up_proj) else norm)(h, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(llama.LlamaModel):
    """Llama's model (forward, sampled rows, CUDA-graph pieces) with Gemma's layers, two rotary
    tables (global and local) and the scaled embedding."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, max_positions: int, ops: LayerOps, tp: TPGroup,
                 quantization: str | None = None) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.embed_scale = arch.hidden_size**0.5  # multiplied in the weights' dtype, as transformers does
        self._rounded_scales: dict[torch.dtype, float] = {}  # embed_scale rounded to each activations' dtype
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope, ops)
        self.rotary_local = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_local or arch.rope, ops)
        shard = local_arch(arch, tp.world_size)
        layers = []
        for i in range(arch.num_layers):
            window = arch.layer_window(i)
            rotary = self.rotary if window is None else self.rotary_local
            layers.append(DecoderLayer(shard, backend, rotary, ops, tp, quantization, window))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # the scale rounded to the activations' dtype first (a Python number: CUDA graphs keep it)
        scale = self._rounded_scales.get(x.dtype)
        if scale is None:  # once per dtype, not a tensor made every step
            scale = self._rounded_scales[x.dtype] = torch.tensor(self.embed_scale, dtype=x.dtype).item()
        return x * scale


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Llama causal LM's loading and logits over a Gemma 3 model."""

    model_class = Gemma3Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_hf_weights(weights))

    def lora_consumers(self) -> list[tuple[nn.Module, nn.Module, str]]:
        raise NotImplementedError("Gemma 3 refuses LoRA (FAMILY.unsupported)")


def _hf_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under the causal LM's names (a multimodal checkpoint's language model;
    its vision tower skipped), norms as the stored 1 + w (computed in float32, as Gemma's norm)."""
    for name, tensor in weights:
        name = _language_model_name(name)
        if name is None:
            continue
        if name.endswith("norm.weight"):
            tensor = (1.0 + tensor.to(torch.float32)).to(tensor.dtype)
        yield name, tensor


def _language_model_name(name: str) -> str | None:
    for prefix, target in (("model.language_model.", "model."), ("language_model.model.", "model."),
                           ("language_model.lm_head.", "lm_head.")):  # fmt: skip
        if name.startswith(prefix):
            return target + name.removeprefix(prefix)
    if name.startswith(("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                        "model.multi_modal_projector.")):  # fmt: skip
        return None
    return name


# ---- the family's declarations (model/interface.py) ----


def parse_config(cfg: dict) -> ModelArch:
    """config.json of Gemma3ForCausalLM (model_type gemma3_text), or the text part of
    Gemma3ForConditionalGeneration's (`text_config`)."""
    architecture = next((a for a in cfg.get("architectures") or [] if a in ARCHITECTURES), "Gemma3ForCausalLM")
    text = {**cfg.get("text_config", {})} if "text_config" in cfg else cfg
    act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"Gemma 3 with hidden_activation {act!r} is not supported")
    if text.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("Gemma 3 with attn_logit_softcapping is not supported")
    if text.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
    num_layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if not layer_types:
        pattern = int(text.get("sliding_window_pattern", 6))
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    rope_params = text.get("rope_parameters") or {}
    if FULL in rope_params or SLIDING in rope_params:  # transformers 5's per-layer-type spelling
        rope = parse_rope({}, {"rope_theta": 1_000_000.0, **(rope_params.get(FULL) or {})})
        rope_local = parse_rope({}, {"rope_theta": 10_000.0, **(rope_params.get(SLIDING) or {})})
    else:
        rope = parse_rope({**text, "rope_theta": text.get("rope_theta", 1_000_000.0)})
        rope_local = parse_rope({}, {"rope_theta": float(text.get("rope_local_base_freq", 10_000.0))})
    num_heads = text.get("num_attention_heads", 8)
    return ModelArch(
        architecture=architecture,
        family="gemma3",
        vocab_size=text.get("vocab_size", 262_208),
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=text.get("num_key_value_heads") or num_heads,
        head_dim=text.get("head_dim", 256),
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        max_position_embeddings=text.get("max_position_embeddings", 131_072),
        rope=rope,
        tie_word_embeddings=cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True)),
        attention_bias=bool(text.get("attention_bias", False)),
        o_proj_bias=bool(text.get("attention_bias", False)),
        qk_norm=True,
        mlp_bias=False,
        sliding_window=text.get("sliding_window", 4096),
        bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id", 2)),
        eos_token_ids=eos_token_ids(text) or eos_token_ids(cfg) or (1,),
        torch_dtype=text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype"),
        hidden_act=act,
        layer_types=tuple(layer_types),
        query_pre_attn_scalar=float(text.get("query_pre_attn_scalar", 256)),
        rope_local=rope_local,
        final_logit_softcapping=text.get("final_logit_softcapping"),
    )


# GGUF: llama.cpp's names of Gemma 3's tensors; it stores each norm as 1 + w (undone here, so the
# Hugging Face weights come out, as transformers reads the file)
GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
GGUF_LAYER = {
    **llama.GGUF_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gguf_values(hf_name: str, tensor: torch.Tensor, arch: ModelArch, gguf_arch: str) -> torch.Tensor:
    return tensor - 1 if hf_name.endswith("norm.weight") else tensor


def _gguf_config(ckpt, config: dict) -> dict:
    """Gemma 3's GGUF keeps the window; the rest are transformers' Gemma 3 defaults, as it reads the file."""
    window = ckpt.arch_key("attention.sliding_window")
    return {**config, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "sliding_window": int(window) if window is not None else 4096, "sliding_window_pattern": 6,
            "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": config["head_dim"],
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": "output.weight" not in ckpt.tensors}  # fmt: skip


def _build(arch: ModelArch, *args, **kwargs) -> Gemma3ForCausalLM:
    return Gemma3ForCausalLM(arch, *args, **kwargs)


FAMILY = ModelFamily(
    name="Gemma 3",
    architectures=ARCHITECTURES,
    model_types=("gemma3_text", "gemma3"),
    gguf_architectures=("gemma3",),
    parse_config=parse_config,
    build=_build,
    linears=lambda arch: tuple(dataclasses.replace(s, lora=False) for s in linear_specs(arch)),
    attention=attention_specs,
    gguf_config=_gguf_config,
    gguf_tensor_name=gguf_name_mapper(GGUF_GLOBAL, GGUF_LAYER, "Gemma 3"),
    gguf_tensor_values=_gguf_values,
    unsupported={
        "lora": "its post-attention and post-feed-forward norms sit where the Llama family's fused "
        "LoRA adds are; not implemented yet"
    },  # fmt: skip
)
