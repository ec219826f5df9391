"""Build a model (its family's, model/registry.py) on the meta device and fill it from safetensors
files, a GGUF file or dummy weights."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from llmserve.model.arch import ModelArch
from llmserve.model.attention import AttentionBackend
from llmserve.model.gguf_keep import gguf_kept_loader, keep_gguf_quantized
from llmserve.model.int8_embedding import log_saving, use_int8_embedding
from llmserve.model.interface import CausalLM
from llmserve.model.layers import REFERENCE_OPS, LayerOps, RotaryEmbedding
from llmserve.model.pipeline import WHOLE, PipelineStage, stage_keeps
from llmserve.model.registry import family_of
from llmserve.model.tensor_parallel import SINGLE, TPGroup
from llmserve.model.w4a16_checkpoint import W4A16Loader, draw_dummy_w4a16, w4a16_loader

logger = logging.getLogger(__name__)


def load_model(
    model_dir: str,
    arch: ModelArch,
    dtype: torch.dtype,
    device: str,
    backend: AttentionBackend,
    load_format: str = "auto",
    seed: int = 0,
    progress: bool = True,
    max_positions: int | None = None,
    ops: LayerOps = REFERENCE_OPS,
    tp: TPGroup = SINGLE,
    quantization: str | None = None,
    quantization_ignore: tuple[str, ...] = (),
    stage: PipelineStage = WHOLE,
    int8_embedding: bool = False,
) -> CausalLM:
    """`max_positions` bounds the rotary table (the engine's max_model_len); `ops` picks
    the elementwise kernels (PyTorch references or fused Triton kernels); `tp` is this
    rank's tensor-parallel group (each rank builds and loads only its shard); `quantization`
    "fp8" gives the projections FP8 weights, quantized from the checkpoint as it loads, except
    the modules `quantization_ignore` names; "gguf" keeps a GGUF file's blocks (model/gguf_linear.py).
    `int8_embedding`: the embedding's rows in int8 (model/int8_embedding.py)."""
    start = time.perf_counter()
    with torch.device("meta"):
        built_as = None if quantization == "gguf" else quantization
        model = family_of(arch).build(arch, backend, max_positions, ops, tp, built_as, quantization_ignore)
        if not stage.whole:  # a pipeline stage: the other stages' layers never get memory
            model.set_pipeline_stage(stage)
        if quantization == "gguf":  # a GGUF file's projections keep their blocks (model/gguf_keep.py)
            keep_gguf_quantized(model, model_dir, arch, ops.gguf_matmul, tp)
        embedding = use_int8_embedding(model, dtype) if int8_embedding else None
        for param in model.parameters():  # the final dtype, but FP8 weights and their float32 scales stay
            if param.dtype == torch.float32 and not _is_scale(model, param):
                param.data = param.data.to(dtype)
    model = model.to_empty(device=device)  # allocate once
    for module in model.modules():  # buffers computed, not loaded: the rotary tables
        if isinstance(module, RotaryEmbedding):
            module.rebuild(torch.device(device))
    fill_weights(model, model_dir, arch, load_format, seed, tp, progress, stage)
    if embedding is not None and tp.rank == 0:
        log_saving(embedding, arch.tie_word_embeddings)
    if progress:
        params = sum(p.numel() for p in model.parameters())
        logger.info("loaded %s (%.1fM parameters, %s, %s) in %.1f s", model_dir if load_format != "dummy" else "dummy weights",
                    params / 1e6, str(dtype).removeprefix("torch."), device, time.perf_counter() - start)  # fmt: skip
    return model.eval()


def fill_weights(model: CausalLM, model_dir: str, arch: ModelArch, load_format: str = "auto", seed: int = 0,
                 tp: TPGroup = SINGLE, progress: bool = True, stage: PipelineStage = WHOLE) -> None:  # fmt: skip
    """Fill an allocated model's parameters: from the checkpoint, or dummy weights (the same
    ones for the same seed). Also how a model that slept at level 2 gets its weights back.
    A pipeline stage reads only its own tensors (model/pipeline.py `stage_keeps`)."""
    if load_format == "dummy":  # (a GPTQ / AWQ model's 4-bit layers drawn as its checkpoint would fill them)
        w4a16 = w4a16_loader(model, Path(model_dir)) if not Path(model_dir).is_file() else None
        _init_dummy(model, seed + tp.rank + 1000 * stage.index, w4a16)
        return
    kept = gguf_kept_loader(model, Path(model_dir), arch, tp)  # GGUF blocks kept quantized (model/gguf_keep.py)
    tensors = _checkpoint_tensors(Path(model_dir), arch, progress, kept.take if kept is not None else None)
    if not stage.whole:
        tensors = ((n, t) for n, t in tensors if stage_keeps(n, stage, arch.tie_word_embeddings))
    w4a16 = w4a16_loader(model, Path(model_dir)) if not Path(model_dir).is_file() else None
    if w4a16 is not None:  # a GPTQ / AWQ checkpoint's 4-bit tensors, repacked (model/w4a16_checkpoint.py)
        tensors = w4a16.take(tensors)
    loaded = model.load_weights(tensors)
    if w4a16 is not None:
        loaded |= w4a16.finish()
    if kept is not None:
        loaded |= kept.finish()
    missing = model.expected_weight_keys() - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {sorted(missing)[:5]} ...")


def _checkpoint_tensors(path: Path, arch: ModelArch, progress: bool, take=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) from a GGUF file (dequantized, but for those `take` takes) or a
    folder of safetensors."""
    if path.is_file():
        from llmserve.model.gguf.checkpoint import open_gguf
        from llmserve.model.gguf.weights import iter_gguf_weights

        return iter_gguf_weights(open_gguf(path), arch, progress, take)
    return _iter_tensors(safetensors_files(path), progress)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}; use load_format='dummy' for random weights")
    return files


def _iter_tensors(files: list[Path], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)


def _fp8_pairs(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(FP8 or INT8 weight, its float32 scale) of every such layer: linear layers and FP8 experts."""
    from llmserve.model.fp8 import Fp8Linear
    from llmserve.model.int8 import Int8Linear

    pairs = []
    for m in model.modules():
        if isinstance(m, (Fp8Linear, Int8Linear)):
            pairs.append((m.weight, m.weight_scale))
        elif hasattr(m, "fp8_pairs"):  # model/moe_block.py Experts
            pairs += m.fp8_pairs()
    return pairs


def _is_scale(model: torch.nn.Module, param: torch.Tensor) -> bool:
    return any(param is scale for _, scale in _fp8_pairs(model))


def _init_dummy(model: torch.nn.Module, seed: int, w4a16: W4A16Loader | None = None) -> None:
    """Small random weights (norms at 1), enough for benchmarks: speed does not depend on values.
    FP8 and INT8 weights are drawn in float32 and quantized, as a checkpoint's would be; 4-bit
    (GPTQ / AWQ) layers likewise, part by part, then read through the checkpoint's loader `w4a16`
    (model/w4a16_checkpoint.py `draw_dummy_w4a16`)."""
    from llmserve.model.int8 import quantize_rows_as
    from llmserve.model.w4a16 import W4A16Linear

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        fp8 = {id(weight): scale for weight, scale in _fp8_pairs(model)}
        scales = {id(scale) for scale in fp8.values()}
        four_bit = {id(p) for m in model.modules() if isinstance(m, W4A16Linear)
                    for p in (m.qweight, m.scales, m.zeros, m.g_idx)}  # fmt: skip
        for name, param in model.named_parameters():
            if id(param) in four_bit:
                continue  # drawn below, with the checkpoint's loader
            if id(param) in fp8:  # rows of the last dimension each get a scale (an expert's too)
                draw = torch.empty(param.shape, dtype=torch.float32, device=device).uniform_(-0.02, 0.02, generator=gen)
                q, scale = quantize_rows_as(param.dtype, draw.reshape(-1, param.shape[-1]))
                param.copy_(q.reshape(param.shape))
                dest = fp8[id(param)]  # per row; block scales (FP8 experts) take the largest: any sane one serves
                dest.copy_(
                    scale.reshape(dest.shape) if scale.numel() == dest.numel() else scale.max().expand(dest.shape)
                )
            elif id(param) in scales:
                continue  # set with its weight
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.uniform_(-0.02, 0.02, generator=gen)
        if four_bit:
            if w4a16 is None:
                raise ValueError("dummy 4-bit weights need the checkpoint's quantization_config (config.json)")
            draw_dummy_w4a16(w4a16, gen)
