"""Mixture of experts in plain PyTorch: the reference the fused kernels (kernels/fused_moe.py) are
tested against, and the path the model runs on CPU.

A router scores each token against E experts; the token goes to its `top_k` best, each a gated MLP
(down(silu(gate(x)) * up(x))), and its output is their sum weighted by the router's softmax
probabilities (renormalised over the chosen k when asked). Qwen2-MoE adds a shared expert that
every token passes, scaled by a sigmoid gate. Written in transformers' op order (softmax in float32,
`torch.topk`, experts in index order, `index_add_`), because greedy equality with it is the oracle.

Layouts: the experts' gate and up rows stacked as one tensor `w13 [E, 2 * I, H]` (gate rows
first, as transformers' fused `gate_up_proj` holds them) and `w2 [E, H, I]`. FP8 experts
(float8_e4m3fn) carry float32 scales: one per output channel (`[E, N, 1]`), or one per
`block_shape` (bn, bk) block of the weight (`[E, ceil(N / bn), ceil(K / bk)]`, the layout of
`quant_method: fp8` checkpoints with `weight_block_size`); the tokens are quantized per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64), best first."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def local_ids(ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """Expert ids as a rank that holds experts [first_expert, first_expert + num_local) indexes its
    weights (expert parallelism), -1 where another rank holds the expert: a rank adds only its
    experts' share of each token, and the ranks' sums add up to the whole."""
    local = ids - first_expert
    return torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, -1))


def dequantize_experts(
    w: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int] | None = None
) -> torch.Tensor:
    """FP8 weights `[..., N, K]` in float32: times their scale per output channel (`[..., N, 1]`),
    or per (bn, bk) block (`[..., ceil(N / bn), ceil(K / bk)]`, the last blocks partial)."""
    if block_shape is not None:
        from llmserve.model.fp8_blocks import dequantize_blocks

        return dequantize_blocks(w, scale, block_shape)
    return w.to(torch.float32) * scale


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [T, H]; each token through its experts `ids [T, k]` (-1: an expert not held here, skipped),
    outputs summed with `weights [T, k]` (the product in float32, rounded to x's dtype before the
    sum): [T, H]. FP8 experts (`w13_scale`, `w2_scale` given: weights in float8_e4m3fn, float32
    scales per output channel, or per `block_shape` block): the tokens and the SiLU-and-mul rows
    (rounded to x's dtype first, as the fused kernel stores them) are quantized to FP8 per row as well,
    and the products run in float32 on the dequantized values."""
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    fp8 = w13_scale is not None
    if fp8:
        from llmserve.model.fp8 import quantize_tokens

        xq, sx = quantize_tokens(x)
        x_in = xq.to(torch.float32) * sx
    else:
        x_in = x
    hit = torch.zeros(num_experts + 1, dtype=torch.bool, device=x.device)
    hit[ids.reshape(-1)] = True  # -1 marks the last entry, which no expert is
    for e in hit[:num_experts].nonzero().reshape(-1).tolist():  # only experts that some token chose
        token, slot = torch.where(ids == e)
        if fp8:
            gate, up = F.linear(x_in[token], dequantize_experts(w13[e], w13_scale[e], block_shape)).chunk(2, dim=-1)
            aq, sa = quantize_tokens((F.silu(gate) * up).to(x.dtype))  # stored in x's dtype, as the kernel does
            h = F.linear(aq.to(torch.float32) * sa, dequantize_experts(w2[e], w2_scale[e], block_shape))
        else:
            gate, up = F.linear(x_in[token], w13[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, token, (h * weights[token, slot, None]).to(x.dtype))
    return out


def fused_moe_reference(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
    first_expert: int = 0, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The routed experts' output [T, H] (`LayerOps.fused_moe`'s signature: kernels/fused_moe.py
    `fused_moe` computes the same). The router scores every expert; `w13`/`w2` may hold only
    experts [first_expert, first_expert + len(w13)) (expert parallelism): the output is then
    their share. FP8 experts: their scales given, per channel or per `block_shape` block
    (`experts_reference`)."""
    weights, ids = route_reference(router_logits, top_k, renormalize)
    if w13.shape[0] != router_logits.shape[-1]:
        ids = local_ids(ids, first_expert, w13.shape[0])
    return experts_reference(x, w13, w2, weights, ids, w13_scale, w2_scale, block_shape)


def shared_expert_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """Qwen2-MoE's shared expert: sigmoid(x @ gate^T) * down(silu(x @ g^T) * (x @ u^T)), with
    `gate_up [2 * I_shared, H]` (gate rows first), `down [H, I_shared]`, `gate [1, H]`."""
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return torch.sigmoid(F.linear(x, gate)) * F.linear(F.silu(g) * u, down)


def moe_block_reference(
    x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """A whole sparse MoE block: router `[E, H]` logits, the routed experts, plus the shared expert
    (gate_up, down, gate) where given."""
    out = fused_moe_reference(x, F.linear(x, router), w13, w2, top_k, renormalize)
    return out if shared is None else out + shared_expert_reference(x, *shared)
