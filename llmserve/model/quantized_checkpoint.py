"""Which quantized format a checkpoint's `quantization_config` describes, read by its own module:
FP8 (model/fp8_checkpoint.py), W8A8 INT8 (model/int8_checkpoint.py), GPTQ / AWQ 4-bit
(model/w4a16_checkpoint.py). Each answer has a `method`, the engine's quantization it runs as
("fp8", "int8", "gptq", "awq"), and a `format`; anything else is refused at start, naming the
reason (an `UnsupportedModelError`)."""

from __future__ import annotations

from llmserve.model.fp8_checkpoint import CheckpointQuantization
from llmserve.model.int8_checkpoint import Int8Checkpoint, is_int8_config, read_int8_quantization
from llmserve.model.w4a16_checkpoint import METHODS as W4A16_METHODS
from llmserve.model.w4a16_checkpoint import W4A16Checkpoint, read_w4a16_quantization

QuantizedCheckpoint = CheckpointQuantization | Int8Checkpoint | W4A16Checkpoint


def read_checkpoint_quantization(cfg: dict) -> QuantizedCheckpoint | None:
    """The quantized format of a config.json (None: not quantized)."""
    from llmserve.model import fp8_checkpoint

    qc = cfg.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") in W4A16_METHODS:
        return read_w4a16_quantization(cfg)
    if is_int8_config(qc):
        return read_int8_quantization(cfg)
    return fp8_checkpoint.read_checkpoint_quantization(cfg)
