"""Can this model be the draft model of that target? Checked at start (`EngineArgs`), so a
draft that could never propose a useful token, or one the draft runner cannot hold, is refused
with a clear error instead of running.

The draft is a Hugging Face folder or a GGUF file, as a target is. It must speak the target's
tokens: the same vocabulary size and, when it has a tokenizer, the same token -> id map over the
ids the models can make. Its family may be any registered one whose layers share one KV layout
(the draft keeps one block table a request: engine/spec_draft.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from llmserve.config import ConfigError, ModelConfig, SpeculativeConfig, read_arch
from llmserve.engine.kv_sizing import kv_layout
from llmserve.model.arch import ModelArch, UnsupportedModelError, read_model_arch

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_draft_model(spec: SpeculativeConfig, target: ModelConfig) -> SpeculativeConfig:
    """`spec` with the draft's architecture, once the draft is found fit for `target`."""
    folder = Path(spec.model)
    if folder.is_file():  # a GGUF file: its weights dequantized as they load, its own tokenizer
        arch = read_arch(folder, own_tokenizer=True)
    else:
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"speculative_config: the draft model folder {folder} has no config.json")
        if "quantization_config" in json.loads(config_file.read_text()):
            raise ConfigError(f"speculative_config: the draft model {folder} is a quantized checkpoint; quantized "
                              "drafts are not supported yet")  # fmt: skip
        try:
            arch = read_model_arch(folder)
        except UnsupportedModelError as exc:
            raise ConfigError(f"speculative_config: the draft model {folder}: {exc}") from None
    _check_vocabulary(arch, target, folder)
    layout = kv_layout(arch)
    if not layout.simple:
        raise ConfigError(f"speculative_config: the draft model {folder} ({arch.architecture}) has several KV groups "
                          f"({layout}); drafts with sliding-window layers are not supported yet")  # fmt: skip
    return dataclasses.replace(spec, draft_arch=arch)


def _check_vocabulary(arch: ModelArch, target: ModelConfig, folder: Path) -> None:
    if arch.vocab_size != target.arch.vocab_size:
        raise ConfigError(
            f"speculative_config: the draft model's vocabulary ({arch.vocab_size} tokens, {folder}) differs from "
            f"the target's ({target.arch.vocab_size}): a draft must use the target's tokenizer"
        )
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        logger.warning("the draft model %s has no tokenizer files: only its vocabulary size (%d) was checked "
                       "against the target's", folder, arch.vocab_size)  # fmt: skip
        return
    from llmserve.tokenizer import load_tokenizer

    # the tokens the models can make (a tokenizer may add tokens past the embedding: never sampled)
    size = arch.vocab_size
    draft_vocab = {t: i for t, i in load_tokenizer(str(folder)).get_vocab().items() if i < size}
    target_vocab = {t: i for t, i in load_tokenizer(target.tokenizer).get_vocab().items() if i < size}
    if draft_vocab != target_vocab:
        differ = sum(1 for t in set(draft_vocab) | set(target_vocab) if draft_vocab.get(t) != target_vocab.get(t))
        raise ConfigError(
            f"speculative_config: the draft model's tokenizer ({folder}) is not the target's: {differ} tokens "
            f"differ ({len(draft_vocab)} against {len(target_vocab)} tokens); a draft must use the target's tokenizer"
        )
