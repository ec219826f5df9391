"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) over a flattened batch.

Reads top to bottom: attention → MLP → decoder layer → model → causal LM. Inputs are
flat: `input_ids [T]`, `positions [T]` and the attention metadata of the batch; the
variants differ only by flags on `ModelArch` (qkv bias, q/k norm, tied embeddings).
q/k/v and gate/up projections are fused into one matmul each; `load_weights` maps the
Hugging Face parameter names onto them. With tensor parallelism (`tp`), `arch` given to
the layers is the rank's share (`local_arch`): fewer heads, a narrower MLP. `FAMILY` at the end
declares the family to the registry (model/interface.py): its configs, shapes and GGUF names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from llmserve.attention_metadata import SampledRows
from llmserve.model.arch import SLIDING, ModelArch, UnsupportedModelError, eos_token_ids, parse_rope
from llmserve.model.attention import AttentionBackend, AttentionMetadata
from llmserve.model.fp8 import Fp8Linear, Fp8Tokens, is_fp8, keep_unquantized, make_linear
from llmserve.model.int8 import is_quantized, quantize_rows_as
from llmserve.model.interface import AttentionSpec, HiddenCapture, LinearSpec, ModelFamily
from llmserve.model.kv_scales import checkpoint_scale_target, checkpoint_scale_value
from llmserve.model.layers import REFERENCE_OPS, LayerOps, RMSNorm, RotaryEmbedding
from llmserve.model.moe_gguf import GGUF_EXPERT_LAYER
from llmserve.model.pipeline import WHOLE, MissingLayer, PipelineStage
from llmserve.model.tensor_parallel import (
    SINGLE,
    TPGroup,
    VocabParallelEmbedding,
    local_arch,
    rank_slice,
)


def takes_fp8_tokens(layer: nn.Module) -> bool:
    """Whether `layer` is an FP8 linear layer that takes activations already quantized."""
    return isinstance(layer, Fp8Linear) and layer.takes_fp8_tokens


class Attention(nn.Module):
    def __init__(
        self, arch: ModelArch, backend: AttentionBackend, rotary: RotaryEmbedding, ops: LayerOps, tp: TPGroup,
        quantization: str | None = None, window: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.arch = arch
        self.backend = backend
        self.window = window  # sliding-window attention (Mistral): keys in (p - window, p]
        self.scale = (arch.query_pre_attn_scalar or arch.head_dim) ** -0.5
        self.qkv_proj = make_linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, arch.attention_bias,
                                    quantization, ops.fp8_matmul, gemm=ops.fp8_gemm, linear=ops.linear, ops=ops)  # fmt: skip
        self.o_proj = make_linear(arch.q_size, arch.hidden_size, arch.o_proj_bias, quantization, ops.fp8_matmul, tp,
                                  ops.fp8_gemm, ops.linear, ops=ops)  # fmt: skip
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, ops)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, ops)
        self.rotary = [rotary]  # shared by every layer; a list keeps it out of this module's state
        self.kv_cache = torch.empty(0)  # bound by the model runner
        self.kv_group = 0  # its KV group (engine/kv_layout.py), bound by the model runner: its block table
        # an FP8 cache's key and value scales (the stored value times the scale is the value): a
        # checkpoint's, calibrated at start (model/kv_scales.py), or 1; plain floats, so a CUDA
        # graph captures them
        self.kv_scales: tuple[float, float] = (1.0, 1.0)

    def project(
        self, positions: torch.Tensor, x: torch.Tensor | Fp8Tokens
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D], rotated: everything before the cache."""
        a = self.arch
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = q.view(-1, a.num_heads, a.head_dim)
        k = k.view(-1, a.num_kv_heads, a.head_dim)
        v = v.view(-1, a.num_kv_heads, a.head_dim)
        if a.qk_norm:  # both norms in one call (one launch on the GPU)
            q, k = self.q_norm.ops.qk_rms_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q, k = self.rotary[0](positions, q, k)
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Write k/v to the cache and attend over it: [T, q_size] (into `out` if given)."""
        if self.kv_group:
            meta = meta.groups[self.kv_group - 1]
        window = {} if self.window is None else {"window": self.window}
        return self.backend(q, k, v, self.kv_cache, meta, self.scale, out=out, kv_scales=self.kv_scales,
                            **window).reshape(-1, self.arch.q_size)  # fmt: skip


class MLP(nn.Module):
    """down(act(gate) * up), the activation `arch.hidden_act`: SiLU (SwiGLU) or tanh GELU (GeGLU)."""

    def __init__(self, arch: ModelArch, ops: LayerOps, tp: TPGroup, quantization: str | None = None) -> None:
        super().__init__()
        if arch.hidden_act == "gelu_pytorch_tanh":
            self.act, self.act_fp8 = ops.gelu_tanh_and_mul, ops.gelu_tanh_and_mul_fp8
        else:
            self.act, self.act_fp8 = ops.silu_and_mul, ops.silu_and_mul_fp8
        self.gate_up_proj = make_linear(arch.hidden_size, 2 * arch.intermediate_size, arch.mlp_bias, quantization,
                                        ops.fp8_matmul, gemm=ops.fp8_gemm, linear=ops.linear, ops=ops)  # fmt: skip
        self.down_proj = make_linear(arch.intermediate_size, arch.hidden_size, arch.mlp_bias, quantization,
                                     ops.fp8_matmul, tp, ops.fp8_gemm, ops.linear, ops=ops)  # fmt: skip

    def forward(self, x: torch.Tensor | Fp8Tokens) -> torch.Tensor:
        """`x`: the normalised hidden states, or with FP8 layers already quantized (Fp8Tokens)."""
        h = self.gate_up_proj(x)
        if takes_fp8_tokens(self.down_proj):  # the activation quantizes for the FP8 layer in its pass
            return self.down_proj(self.act_fp8(h))
        return self.down_proj(self.act(h))


class DecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, backend: AttentionBackend, rotary: RotaryEmbedding, ops: LayerOps, tp: TPGroup,
        quantization: str | None = None, window: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = Attention(arch, backend, rotary, ops, tp, quantization, window)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp = MLP(arch, ops, tp, quantization)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.begin(positions, x, residual)
        return self.finish(self.self_attn.attend(q, k, v, meta), residual)

    def forward_sampled(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, sampled: SampledRows,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`forward`'s output for `sampled.rows` alone: every row's keys and values go to the
        cache; only those rows attend, and only they pass the output projection and the MLP."""
        q, k, v, residual = self.begin(positions, x, residual)
        rows = sampled.rows
        attn_out = self.self_attn.attend(q[rows], k, v, sampled.meta)
        if rows.shape[0] == 0:  # no row samples (a prompt's middle chunk): the cache was all it needed
            return attn_out, residual[:0]
        return self.finish(attn_out, residual[rows])

    def begin(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Before attention: norm (adding the residual), project: (q, k, v, residual)."""
        # FP8 layers without a static input scale take their input quantized by the norm's kernel
        norm = self.input_layernorm.fp8 if takes_fp8_tokens(self.self_attn.qkv_proj) else self.input_layernorm
        if residual is None:
            residual = x
            x = norm(x)
        else:
            x, residual = norm(x, residual)
        return (*self.self_attn.project(positions, x), residual)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After attention: output projection, norm (adding the residual), MLP."""
        norm = self.post_attention_layernorm
        x, residual = (norm.fp8 if takes_fp8_tokens(self.mlp.gate_up_proj) else norm)(self.self_attn.o_proj(attn_out),
                                                                                     residual)  # fmt: skip
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(
        self, arch: ModelArch, backend: AttentionBackend, max_positions: int, ops: LayerOps, tp: TPGroup,
        quantization: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope, ops)
        shard = local_arch(arch, tp.world_size, tp.expert_parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(shard, backend, self.rotary, ops, tp, quantization, arch.layer_window(i))
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    stage = WHOLE  # the pipeline stage this model runs (model/pipeline.py): its layers, first or last
    capture: HiddenCapture | None = None  # hidden states kept for an EAGLE head (model/interface.py)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        sampled: SampledRows | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The final hidden states of every row, or with `sampled` of its rows alone (in order):
        the last layer then runs past its cache write on those rows only."""
        return self.forward_stage(input_ids, positions, meta, None, sampled)

    def forward_stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        carried: tuple[torch.Tensor, torch.Tensor] | None, sampled: SampledRows | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """This stage's layers: from the embedding (first stage) or the previous stage's
        `carried` (hidden states, residual); returns the final hidden states (last stage, as
        `forward`), else the (hidden states, residual) for the next stage."""
        stage = self.stage
        x, residual = (self.embed(input_ids), None) if carried is None else carried
        indices = stage.layers(len(self.layers))  # (global: a capture names the whole model's layers)
        layers = [self.layers[i] for i in indices]
        last_sampled = sampled is not None and stage.is_last
        capture = self.capture
        if capture is not None:
            capture.states = []
        for i, layer in zip(indices, layers[:-1] if last_sampled else layers):
            if capture is not None and i in capture.layers:
                capture.states.append(x if residual is None else x + residual)
            x, residual = layer(positions, x, residual, meta)
        if not stage.is_last:
            return x, residual
        if last_sampled:
            if capture is not None and indices[-1] in capture.layers:
                capture.states.append(x + residual)
            x, residual = layers[-1].forward_sampled(positions, x, residual, sampled)
            if x.shape[0] == 0:
                return x
        x, _ = self.norm(x, residual)
        if capture is not None and capture.final:
            capture.states.append(x)
        return x

    # The forward cut at its attention calls, for piecewise CUDA graphs (attention, whose
    # launch depends on the batch's shape beyond its token count, runs between pieces):
    # piece 0 = embedding + layer 0 before attention; piece i = layer i-1 after attention
    # + layer i before it; the last piece = the last layer after attention + final norm.
    def first_piece(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.layers[0].begin(positions, self.embed(input_ids), None)

    def middle_piece(
        self, i: int, attn_out: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x, residual = self.layers[i - 1].finish(attn_out, residual)
        return self.layers[i].begin(positions, x, residual)

    def last_piece(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x, residual = self.layers[-1].finish(attn_out, residual)
        return self.norm(x, residual)[0]


# Hugging Face name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def _is_vocab(target: str) -> bool:
    """Split over the vocabulary: the embedding (an int8 one's row scales too) and the LM head."""
    return target in ("model.embed_tokens.weight", "model.embed_tokens.weight_scale", "lm_head.weight")


def _split_dim(target: str) -> int | None:
    """The dimension tensor parallelism splits this parameter along (None: replicated)."""
    if ".qkv_proj." in target or ".gate_up_proj." in target or _is_vocab(target):
        return 0  # column-parallel (weights and biases) and vocabulary rows
    if target.endswith((".o_proj.weight", ".down_proj.weight")):
        return 1  # row-parallel: their biases are whole on every rank
    return None


def _copy_rows(dest: torch.Tensor, rows: torch.Tensor) -> None:
    """`dest.copy_(rows)`; the last rank's padded vocabulary rows (fewer in `rows`) zeroed."""
    if rows.shape != dest.shape:
        dest.zero_()
    dest.narrow(0, 0, rows.shape[0]).copy_(rows)


class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel  # the decoder stack (a family that extends this causal LM brings its own)

    def __init__(
        self, arch: ModelArch, backend: AttentionBackend, max_positions: int | None = None,
        ops: LayerOps = REFERENCE_OPS, tp: TPGroup = SINGLE, quantization: str | None = None,
        quantization_ignore: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        """`quantization` "fp8": the projections hold FP8 weights (model/fp8.py), quantized
        from the checkpoint's as they load, except those `quantization_ignore` names (module
        names or `re:` patterns: model/fp8.py `keep_unquantized`)."""
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.quantization = quantization
        self.shard = local_arch(arch, tp.world_size, tp.expert_parallel)
        self.model = self.model_class(
            arch, backend, max_positions or arch.max_position_embeddings, ops, tp, quantization
        )
        self.linear = ops.linear  # the LM head's product
        self.kv_scales_source = "one"  # an FP8 KV cache's scales: "checkpoint" once a checkpoint gives them
        self._kv_scales_read: set[tuple[int, str]] = set()  # (layer, "k" | "v") a checkpoint gave
        if quantization in ("fp8", "int8") and quantization_ignore:
            keep_unquantized(self, quantization_ignore)
        if not arch.tie_word_embeddings:  # the vocabulary rows of this rank, as the embedding's
            self.lm_head = nn.Linear(arch.hidden_size, self.model.embed_tokens.per_rank, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        sampled: SampledRows | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Returns the final hidden states [T, hidden] (`compute_logits` picks rows), or with
        `sampled` those of its rows alone [k, hidden]: the rows that reach the LM head."""
        return self.model(input_ids, positions, meta, sampled)

    def forward_stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        carried: tuple[torch.Tensor, torch.Tensor] | None, sampled: SampledRows | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """A pipeline stage's part of `forward` (model/pipeline.py): (hidden, residual) out of a
        stage before the last, the final hidden states out of the last."""
        return self.model.forward_stage(input_ids, positions, meta, carried, sampled)

    def set_pipeline_stage(self, stage: PipelineStage) -> None:
        """Keep only what `stage` runs (on the meta device, before memory is allocated): its
        decoder layers, the embedding on the first stage (and the last, with a tied head), the
        final norm and the LM head on the last."""
        m = self.model
        m.stage = stage
        for i in range(len(m.layers)):
            if not stage.holds(i):
                m.layers[i] = MissingLayer()
        if not stage.is_first and not (stage.is_last and self.arch.tie_word_embeddings):
            m.embed_tokens.weight = None  # (its vocabulary split stays: the head's logits use it)
        if not stage.is_last:
            m.norm = MissingLayer()
            if hasattr(self, "lm_head"):
                del self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (gathered from every rank)."""
        head = None if self.arch.tie_word_embeddings else self.lm_head.weight
        return self.model.embed_tokens.logits(hidden, head, self.linear)

    def attention_layers(self) -> list[Attention]:
        """The attention of each decoder layer this model holds (a pipeline stage: its own), in order."""
        return [layer.self_attn for layer in self.model.layers if not isinstance(layer, MissingLayer)]

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def embedding_dtype(self) -> torch.dtype:
        return self.model.embed_tokens.dtype  # (an int8 table's: the dtype its rows come out in)

    def token_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def set_hidden_capture(self, capture: HiddenCapture | None) -> None:
        """Keep hidden states for an EAGLE head (`capture`'s layers index the whole model's)."""
        self.model.capture = capture

    def first_piece(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.model.first_piece(input_ids, positions)

    def middle_piece(self, i: int, attn_out: torch.Tensor, residual: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
        return self.model.middle_piece(i, attn_out, residual, positions)

    def last_piece(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.model.last_piece(attn_out, residual)

    def lora_consumers(self) -> list[tuple[nn.Module, nn.Module, str]]:
        """(projection, owner, attribute of the op right after it) for o_proj, gate_up_proj and
        down_proj, layer by layer: the post-attention norm, the MLP's activation, and the next
        layer's input norm (the model's final norm after the last layer). LoRA's overlapped steps
        let these ops add the projections' deltas (lora/deferred.py)."""
        layers = self.model.layers
        out: list[tuple[nn.Module, nn.Module, str]] = []
        for i, layer in enumerate(layers):
            after_down = (layers[i + 1], "input_layernorm") if i + 1 < len(layers) else (self.model, "norm")
            out += [(layer.self_attn.o_proj, layer, "post_attention_layernorm"), (layer.mlp.gate_up_proj, layer.mlp, "act"),
                    (layer.mlp.down_proj, *after_down)]  # fmt: skip
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face tensors into the (fused) parameters; returns names loaded.
        Under tensor parallelism each rank copies its own slice of each tensor."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            kv_target = checkpoint_scale_target(name)
            if kv_target is not None:  # an FP8 KV cache's scale (used with --kv-cache-dtype fp8)
                self._load_kv_scale(name, *kv_target, tensor)
                continue
            target, shard = self._target(name)
            if name.endswith(".input_scale"):  # an FP8 checkpoint's static activation scale
                self._load_input_scale(target, tensor)
                continue
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {self.arch.architecture}")
            param = params[target]
            dest = param.data if shard is None else self._shard_view(target, param, shard)
            if name.endswith(".weight_scale"):  # an FP8 checkpoint's: per tensor, or a row each
                rows = tensor.reshape(-1, 1).to(torch.float32)
                full_rows = self.arch.vocab_size if _is_vocab(target) else \
                    dest.shape[0] * (self.tp.world_size if _split_dim(target) == 0 else 1)  # fmt: skip
                rows = rows.expand(full_rows, 1) if rows.shape[0] == 1 else rows
                if rows.shape[0] != full_rows:
                    raise ValueError(f"{name}: {tuple(tensor.shape)} scales for {full_rows} rows")
                _copy_rows(dest, rows if _split_dim(target) != 0 else rank_slice(rows, 0, dest.shape[0], self.tp.rank))
                loaded.add(target if shard is None else f"{target}#{shard}")
                continue
            dim = _split_dim(target)
            full = list(dest.shape)
            if dim is not None:  # the checkpoint holds every rank's part (the vocabulary unpadded)
                full[dim] = self.arch.vocab_size if _is_vocab(target) else dest.shape[dim] * self.tp.world_size
            if list(tensor.shape) != full:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(full)}")
            part = tensor if dim is None else rank_slice(tensor, dim, dest.shape[dim], self.tp.rank)
            if (
                is_quantized(dest) and tensor.dtype == dest.dtype
            ):  # an FP8 or INT8 checkpoint's weight (its scale comes apart)
                _copy_rows(dest, part)
            elif is_quantized(dest) and not is_quantized(tensor):  # quantized as it loads, rows of this rank's part
                scale_target = target.removesuffix(".weight") + ".weight_scale"
                scale = params[scale_target]
                q, row_scales = quantize_rows_as(dest.dtype, part)  # model/fp8.py, model/int8.py
                _copy_rows(dest, q)
                _copy_rows(scale.data if shard is None else self._shard_view(target, scale, shard), row_scales)
                loaded.add(scale_target if shard is None else f"{scale_target}#{shard}")
            elif is_quantized(dest):
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} but its projection holds {dest.dtype}")
            elif is_quantized(tensor):
                raise ValueError(f"checkpoint tensor {name!r} is {'FP8' if is_fp8(tensor) else 'INT8'} but its projection "
                                 "runs unquantized (the checkpoint's ignore list names it)")  # fmt: skip
            else:
                _copy_rows(dest, part)
            loaded.add(target if shard is None else f"{target}#{shard}")
        self._check_kv_scales()
        return loaded

    def _load_kv_scale(self, name: str, layer: int, which: str, tensor: torch.Tensor) -> None:
        if not 0 <= layer < len(self.model.layers):
            raise KeyError(f"checkpoint tensor {name!r}: no layer {layer} in {self.arch.architecture}")
        value = checkpoint_scale_value(name, tensor)
        attn = self.model.layers[layer].self_attn
        k, v = attn.kv_scales
        attn.kv_scales = (value if which in ("k", "kv") else k, value if which in ("v", "kv") else v)
        self.kv_scales_source = "checkpoint"
        self._kv_scales_read.update({(layer, w) for w in ("k", "v") if w in which})

    def _check_kv_scales(self) -> None:
        """A checkpoint gives both KV scales of every layer, or none (not a silent 1 somewhere)."""
        if not self._kv_scales_read:
            return
        missing = [f"model.layers.{i}.self_attn.{w}_scale" for i in range(len(self.model.layers)) for w in ("k", "v")
                   if (i, w) not in self._kv_scales_read]  # fmt: skip
        if missing:
            raise ValueError(f"the checkpoint gives KV cache scales for some layers but not {', '.join(missing[:4])}"
                             f"{' ...' if len(missing) > 4 else ''}: every layer needs its k_scale and v_scale")  # fmt: skip

    def _load_input_scale(self, target: str, tensor: torch.Tensor) -> None:
        """A static activation scale: the layer quantizes its input with it. q/k/v (gate/up)
        share one input, so the fused layer keeps the largest of their scales."""
        module = self.get_submodule(target.removesuffix(".input_scale"))
        value = tensor.reshape(-1)[0].to(torch.float32).to(module.weight.device)
        if module.input_scale is None:
            module.input_scale = torch.nn.Parameter(value.clone(), requires_grad=False)
        else:
            module.input_scale.data = torch.maximum(module.input_scale.data, value)

    def expected_weight_keys(self) -> set[str]:
        keys = set()
        for name, _ in self.named_parameters():
            if name.endswith(".input_scale"):  # optional: a static FP8 checkpoint's, set as it loads
                continue
            if ".qkv_proj." in name:
                keys.update(f"{name}#{i}" for i in range(3))
            elif ".gate_up_proj." in name:
                keys.update(f"{name}#{i}" for i in range(2))
            else:
                keys.add(name)
        return keys

    @staticmethod
    def _target(name: str) -> tuple[str, int | None]:
        for fragment, (fused, shard) in _STACKED.items():
            if fragment in name:
                return name.replace(fragment, fused), shard
        return name, None

    def fused_widths(self, target: str) -> list[int]:
        """The output widths, on this rank, of the parts of the fused parameter `target` (q, k, v
        of qkv_proj; gate, up of gate_up_proj): where each checkpoint part goes. A family whose
        fused layers are not all the MLP's width (a shared expert) says so here."""
        a = self.shard
        if ".qkv_proj." in target:
            return [a.q_size, a.kv_size, a.kv_size]
        return [a.intermediate_size, a.intermediate_size]

    def _shard_view(self, target: str, param: torch.Tensor, shard: int) -> torch.Tensor:
        sizes = self.fused_widths(target)
        return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])


# ---- the family's declarations (model/interface.py) ----

_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def parse_config(cfg: dict) -> ModelArch:
    """config.json of a Llama, Mistral, Qwen2 or Qwen3 model."""
    arch_name = next((a for a in cfg.get("architectures") or [] if a in _FAMILIES), None)
    if arch_name is None:
        arch_name = {v: k for k, v in _FAMILIES.items()}[cfg.get("model_type", "")]
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
    family = _FAMILIES[arch_name]
    num_heads = cfg["num_attention_heads"]
    window = _sliding_window(cfg, family)
    layer_types = tuple(cfg.get("layer_types") or ())
    if window is not None and not layer_types and family in ("qwen2", "qwen3"):
        # Qwen's sliding layers are those from max_window_layers on
        first = int(cfg.get("max_window_layers", cfg["num_hidden_layers"]))
        layer_types = tuple(SLIDING if i >= first else "full_attention" for i in range(cfg["num_hidden_layers"]))
    return ModelArch(
        architecture=arch_name,
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope=parse_rope(cfg),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=(family == "qwen2") or bool(cfg.get("attention_bias", False)),
        o_proj_bias=family in ("llama", "qwen3") and bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=window,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_token_ids(cfg),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        layer_types=layer_types,
    )


def _sliding_window(cfg: dict, family: str) -> int | None:
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def linear_specs(arch: ModelArch) -> tuple[LinearSpec, ...]:
    """q/k/v and gate/up fused, each column-parallel; o and down row-parallel."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    return (
        LinearSpec("self_attn.qkv_proj", h, ("q_proj", "k_proj", "v_proj"), (q, kv, kv), "column"),
        LinearSpec("self_attn.o_proj", q, ("o_proj",), (h,), "row"),
        LinearSpec("mlp.gate_up_proj", h, ("gate_proj", "up_proj"), (inter, inter), "column"),
        LinearSpec("mlp.down_proj", inter, ("down_proj",), (h,), "row"),
    )


def attention_specs(arch: ModelArch) -> tuple[AttentionSpec, ...]:
    return tuple(AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.layer_window(i))
                 for i in range(arch.num_layers))  # fmt: skip


# GGUF: llama.cpp's names of the Llama block's tensors (and Mixtral's experts: model/moe_gguf.py)
GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_name_mapper(global_names: dict[str, str], layer_names: dict[str, str], family: str):
    """A GGUF tensor name -> Hugging Face name function over these tables (KeyError-free: an
    unknown tensor is an UnsupportedModelError naming the family)."""

    def hf_name(name: str) -> str | None:
        if name == "rope_freqs.weight":  # read into ModelArch (gguf/config.py)
            return None
        if name in global_names:
            return global_names[name]
        match = _GGUF_BLOCK.fullmatch(name)
        if match and match.group(2) in layer_names:
            layer, part, kind = match.groups()
            return f"model.layers.{layer}.{layer_names[part]}.{kind}"
        raise UnsupportedModelError(f"GGUF tensor {name!r} has no place in a {family} model")

    return hf_name


def _gguf_values(hf_name: str, tensor: torch.Tensor, arch: ModelArch, gguf_arch: str) -> torch.Tensor:
    """llama.cpp reorders the rows of q and k of the `llama` architecture within each head (its
    rotary embedding pairs neighbours, Hugging Face's the two halves): undone."""
    if gguf_arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
        from llmserve.model.gguf.weights import unpermute_rotary

        return unpermute_rotary(tensor, arch.num_heads if ".q_proj." in hf_name else arch.num_kv_heads)
    return tensor


def _gguf_config(ckpt, config: dict) -> dict:
    from llmserve.model import moe_gguf

    arch = ckpt.architecture
    if arch == "llama" and moe_gguf.has_experts(ckpt):  # Mixtral: llama.cpp writes it as llama with experts
        return moe_gguf.gguf_config(ckpt, config)
    config = {**config, "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                          "qwen3": "Qwen3ForCausalLM"}[arch]]}  # fmt: skip
    config["attention_bias"] = arch == "llama" and "blk.0.attn_q.bias" in ckpt.tensors
    return config


FAMILY = ModelFamily(
    name="Llama",
    architectures=tuple(_FAMILIES),
    model_types=tuple(_FAMILIES.values()),
    gguf_architectures=("llama", "qwen2", "qwen3"),  # Mistral's GGUFs say llama
    parse_config=parse_config,
    build=lambda *args, **kwargs: LlamaForCausalLM(*args, **kwargs),
    linears=linear_specs,
    attention=attention_specs,
    gguf_config=_gguf_config,
    gguf_tensor_name=gguf_name_mapper(GGUF_GLOBAL, {**GGUF_LAYER, **GGUF_EXPERT_LAYER}, "Llama-family"),  # Mixtral
    gguf_tensor_values=_gguf_values,
)
