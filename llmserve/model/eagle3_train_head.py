"""An EAGLE-3 head as a plain PyTorch module that trains: the same computation as the runtime's
(model/eagle.py `EagleHead`, one Llama decoder layer over concat(input_layernorm(embedding),
hidden_norm(feature))), on padded batches of whole sequences, unrolled over several proposal
steps ("training-time test", as EAGLE-3 trains).

Positions follow the runtime's pairs: the head's position t holds (token t + 1, feature of t) and
predicts token t + 2. Step 0 feeds the target's features (`fc` over the states entering its aux
layers); step j >= 1 at index t stands for the j-th proposal after position t: token t + 1 + j
(the true one: where an earlier proposal was wrong, the target rejects this one anyway) with the
head's own output of step j - 1 at index t as its feature, at rotary position t + j. It attends to
the step-0 keys of positions <= t and to its own chain's keys of steps 1..j at index t: exactly
the head's KV cache when the runtime proposes after position t.

Its state dict carries the published names (`midlayer.*`, `fc`, `norm`, `lm_head`): checkpoint.py
writes it in the format model/eagle_format.py reads. It lives under model/ as the
other Llama-shaped layers do; llmserve/spec_train/ trains it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.arch import ModelArch
from llmserve.model.layers import RMSNorm, apply_rotary, rope_inv_freq


class _Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h, q, kv = arch.hidden_size, arch.q_size, arch.kv_size
        self.q_proj = nn.Linear(2 * h, q, bias=False)
        self.k_proj = nn.Linear(2 * h, kv, bias=False)
        self.v_proj = nn.Linear(2 * h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h, inter = arch.hidden_size, arch.intermediate_size
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = _Attention(arch)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = _MLP(arch)


class Eagle3TrainHead(nn.Module):
    """The head's trainable weights (published names) and its unrolled forward."""

    def __init__(self, arch: ModelArch, num_aux: int, draft_vocab_size: int, max_positions: int) -> None:
        """`arch`: the head's decoder shape (its config.json parsed as a Llama model)."""
        super().__init__()
        h = arch.hidden_size
        self.arch = arch
        self.fc = nn.Linear(num_aux * h, h, bias=False)
        self.midlayer = _MidLayer(arch)
        self.norm = RMSNorm(h, arch.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        inv_freq = rope_inv_freq(arch.head_dim, arch.rope)  # (the runtime's RotaryEmbedding table)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_sin", torch.stack((emb.cos(), emb.sin())), persistent=False)

    def init_weights(self, seed: int) -> None:
        """Linear layers N(0, 0.02) as Llama initialises them, norms 1. (Starting the LM head from
        the target's rows was tried: without the target's final norm, whose weight the model
        interface does not expose, their scale is off and the loss starts higher.)"""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.copy_(torch.randn(module.weight.shape, generator=g) * 0.02)
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)

    def published_tensors(self) -> dict[str, torch.Tensor]:
        """The weights in the published names, float32 on the host."""
        return {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in self.state_dict().items()}

    def unroll(self, embeds: torch.Tensor, states: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The normed output states (what `lm_head` reads) of each step, [B, P, hidden] each.

        `embeds` [B, P + steps, hidden]: the target's embeddings of tokens 1, 2, ... of each
        sequence (right-padded); `states` [B, P, aux * hidden]: the target's captured states of
        positions 0 .. P - 1. Indices past a sequence's end give rows the loss must mask."""
        P = states.shape[1]
        feature = self.fc(states)
        positions = torch.arange(P, device=states.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        layer = self.midlayer
        for j in range(steps):
            normed = layer.hidden_norm(feature)
            x = torch.cat([layer.input_layernorm(embeds[:, j : j + P]), normed], dim=-1)
            q, k, v = self._project(x, positions + j)
            keys.append(k)
            values.append(v)
            h = layer.self_attn.o_proj(self._attend(q, keys, values)) + feature  # (residual: the feature)
            out = layer.mlp(layer.post_attention_layernorm(h)) + h
            outs.append(self.norm(out))
            feature = out  # the next step's feature: the output before the final norm
        return outs

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary's logits of normed output states (one of `unroll`'s)."""
        return self.lm_head(out)

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, P, Hq, D], k and v [B, P, Hkv, D], rotated at `positions` [P]."""
        a, attn = self.arch, self.midlayer.self_attn
        B, P, _ = x.shape
        q = attn.q_proj(x).view(B * P, a.num_heads, a.head_dim)
        k = attn.k_proj(x).view(B * P, a.num_kv_heads, a.head_dim)
        v = attn.v_proj(x).view(B, P, a.num_kv_heads, a.head_dim)
        q, k = apply_rotary(q, k, positions.repeat(B), self.cos_sin)
        return q.view(B, P, a.num_heads, a.head_dim), k.view(B, P, a.num_kv_heads, a.head_dim), v

    def _attend(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """Step len(keys) - 1's attention: causal over step 0's keys, plus its chain's own keys of
        steps 1.. at the same index. [B, P, Hq * D]"""
        a = self.arch
        B, P, H, D = q.shape
        group = a.num_heads // a.num_kv_heads
        ks = [k.repeat_interleave(group, dim=2) for k in keys]
        vs = [v.repeat_interleave(group, dim=2) for v in values]
        scale = a.head_dim**-0.5
        causal = torch.ones(P, P, dtype=torch.bool, device=q.device).tril()
        scores = torch.einsum("bphd,bshd->bhps", q, ks[0]).masked_fill(~causal, float("-inf")) * scale
        chain = [torch.einsum("bphd,bphd->bhp", q, k)[..., None] * scale for k in ks[1:]]
        probs = torch.softmax(torch.cat([scores, *chain], dim=-1).float(), dim=-1).to(q.dtype)
        out = torch.einsum("bhps,bshd->bphd", probs[..., :P], vs[0])
        for i, v in enumerate(vs[1:]):
            out = out + probs[..., P + i].transpose(1, 2)[..., None] * v
        return out.reshape(B, P, H * D)
