"""EAGLE and EAGLE-3 heads: small decoders over the target's hidden states that propose tokens
(engine/spec_eagle.py runs them; model/eagle_format.py reads and checks their checkpoints).

A head's step at position t takes a pair: the token at t + 1 and a feature of position t, the
target's hidden state there (`features`: EAGLE-1 its final state after the final norm, EAGLE-3
`fc` over the states entering three of its layers) or, past the target's tokens, the head's own
output at t - 1. It writes its KV at t, and gives logits for the token at t + 2 and the feature
of position t + 1 (EAGLE-1: its output, whose logits the target's LM head makes; EAGLE-3: its
output before its final norm, whose logits its own reduced-vocabulary LM head makes from after).

The layers are the Llama family's (model/llama.py), with the head's differences: EAGLE-1's first
layer takes fc(concat(embedding, feature)) without an input norm; EAGLE-3's attention takes
concat(input_layernorm(embedding), hidden_norm(feature)), twice the hidden size wide.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.model.attention import AttentionBackend, AttentionMetadata
from llmserve.model.eagle_format import IGNORED, EagleHeadError, EagleSpec, expected_shapes, head_tensors
from llmserve.model.fp8 import make_linear
from llmserve.model.interface import CausalLM, HiddenCapture
from llmserve.model.layers import REFERENCE_OPS, LayerOps, RMSNorm, RotaryEmbedding
from llmserve.model.llama import DecoderLayer
from llmserve.model.tensor_parallel import SINGLE
from llmserve.model.whole_vocab import WholeVocab

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


class EagleHead(nn.Module):
    """One EAGLE or EAGLE-3 head over a target (whose embedding, and for EAGLE-1 LM head, it uses: the
    model, or whole tables of them gathered from its tensor-parallel ranks, model/whole_vocab.py)."""

    def __init__(self, spec: EagleSpec, target: CausalLM | WholeVocab, backend: AttentionBackend, max_positions: int,
                 ops: LayerOps = REFERENCE_OPS) -> None:  # fmt: skip
        super().__init__()
        self.spec = spec
        self._target = [target]  # (a list: not this module's parameters)
        a = spec.arch
        h = a.hidden_size
        self.rotary = RotaryEmbedding(a.head_dim, max_positions, a.rope, ops)
        self.layers = nn.ModuleList(DecoderLayer(a, backend, self.rotary, ops, SINGLE) for _ in range(a.num_layers))
        if spec.eagle3:
            layer = self.layers[0]
            layer.self_attn.qkv_proj = make_linear(2 * h, a.q_size + 2 * a.kv_size, a.attention_bias, None,
                                                   ops.fp8_matmul, linear=ops.linear, ops=ops)  # fmt: skip
            layer.hidden_norm = RMSNorm(h, a.rms_norm_eps, ops)
            self.fc = nn.Linear(len(spec.aux_layers) * h, h, bias=False)
            self.norm = RMSNorm(h, a.rms_norm_eps, ops)
            self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        else:
            self.fc = nn.Linear(2 * h, h, bias=spec.fc_bias)

    def capture(self) -> HiddenCapture:
        """What the target's forward must keep for this head."""
        return HiddenCapture(layers=self.spec.aux_layers, final=not self.spec.eagle3)

    def features(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The target's captured states [T, ...] -> the head's feature of each position [T, hidden]."""
        if self.spec.eagle3:
            return self.fc(torch.cat(states, dim=-1))
        return states[-1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(the states its logits are made from, the features of the next positions), both [T, hidden]."""
        embeds = self._target[0].token_embeddings(input_ids).to(features.dtype)
        if self.spec.eagle3:
            return self._eagle3(positions, embeds, features, meta)
        x = self.fc(torch.cat([embeds, features], dim=-1))
        residual = x
        for i, layer in enumerate(self.layers):
            if i == 0:  # no input norm
                q, k, v = layer.self_attn.project(positions, x)
            else:
                q, k, v, residual = layer.begin(positions, x, residual)
            x, residual = layer.finish(layer.self_attn.attend(q, k, v, meta), residual)
        out = x + residual
        return out, out

    def _eagle3(self, positions: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        layer = self.layers[0]
        normed = layer.hidden_norm(features)
        residual = normed if self.spec.norm_before_residual else features
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        q, k, v = layer.self_attn.project(positions, x)
        x, residual = layer.finish(layer.self_attn.attend(q, k, v, meta), residual)
        return self.norm(x, residual)

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [T, V] (EAGLE-3: -inf outside its draft vocabulary)."""
        if not self.spec.eagle3:
            return self._target[0].compute_logits(states)
        logits = self.lm_head(states)
        vocab = self.spec.arch.vocab_size
        if self.spec.draft_vocab_size == vocab and not self.spec.has_d2t:
            return logits
        full = logits.new_full((logits.shape[0], vocab), float("-inf"))
        ids = torch.arange(self.spec.draft_vocab_size, device=logits.device) + self.d2t
        full[:, ids] = logits
        return full

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers]

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill the parameters from the head's checked tensors (model/eagle_format.py names)."""
        params = dict(self.named_parameters())
        params["d2t"] = getattr(self, "d2t", None)
        _, optional = expected_shapes(self.spec)
        for name, tensor in tensors.items():
            if name in IGNORED or (name in optional and name.startswith("layers.0.input_layernorm")):
                continue
            target, part = _place(name)
            dest = params.get(target)
            if dest is None:
                raise EagleHeadError(f"{self.spec.folder}: tensor {name!r} has no place in the head")
            if part is not None:
                fused, index = part
                widths = _fused_widths(self.spec, fused)
                dest = dest.data.narrow(0, sum(widths[:index]), widths[index])
            if name == "d2t":
                dest.copy_(tensor.to(torch.long))
            else:
                dest.data.copy_(tensor.to(dest.dtype))


def _place(name: str) -> tuple[str, tuple[str, int] | None]:
    """A checkpoint tensor's parameter, and for a fused one (its fused name, its part)."""
    parts = name.split(".")
    for i, piece in enumerate(parts):
        if piece in _FUSED:
            fused, index = _FUSED[piece]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), (fused, index)
    return name, None


def _fused_widths(spec: EagleSpec, fused: str) -> list[int]:
    a = spec.arch
    return [a.q_size, a.kv_size, a.kv_size] if fused == "qkv_proj" else [a.intermediate_size] * 2


def load_eagle_head(spec: EagleSpec, target: CausalLM | WholeVocab, dtype: torch.dtype, device: torch.device,
                    backend: AttentionBackend, max_positions: int, ops: LayerOps = REFERENCE_OPS) -> EagleHead:  # fmt: skip
    """The head of `spec` over `target`, its weights read, on `device` in `dtype`."""
    with torch.device("meta"):
        head = EagleHead(spec, target, backend, max_positions, ops)
    head = head.to_empty(device=device)
    head.rotary.rebuild(device)
    head.load(head_tensors(spec.folder))
    for p in head.parameters():
        p.data = p.data.to(dtype)
    return head.eval()
