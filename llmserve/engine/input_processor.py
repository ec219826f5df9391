"""Front-side request preparation: tokenize, validate, fan n > 1 out into siblings."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from llmserve.config import ModelConfig
from llmserve.engine.request import EngineCoreRequest
from llmserve.engine.request_checks import PromptError, PromptTooLongError, check_request, check_token_ids
from llmserve.engine.structured_output import StructuredOutputs
from llmserve.lora_request import LoRARequest
from llmserve.sampling_params import SamplingParams, token_ids_outside

PromptType = str | dict[str, Any] | list[int]
__all__ = ["InputProcessor", "ProcessedRequest", "PromptError", "PromptTooLongError", "PromptType"]


@dataclass(slots=True)
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    core_requests: list[EngineCoreRequest]  # one per sample (n), in index order


def eos_token_ids(model_dir: str, tokenizer: PreTrainedTokenizerBase, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids from the tokenizer, generation_config.json and config.json together."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    return tuple(sorted(ids))


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(
        self, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase, structured: StructuredOutputs | None = None
    ) -> None:
        """`structured`: the grammar compiler to check specs with (an in-process engine core's,
        so that its cache serves both; the front of a core process has its own)."""
        self.model_config = model_config
        self.tokenizer = tokenizer
        # structured outputs are compiled here too, so a bad spec is the caller's error
        # (a 400) before the request reaches the engine core
        self.structured = structured or StructuredOutputs(model_config.tokenizer, model_config.arch.vocab_size)
        self.eos_token_ids = eos_token_ids(model_config.model, tokenizer, model_config.arch.eos_token_ids)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text (None: ids only) and its ids, checked against the vocabulary
        (a tokenizer's too: its vocabulary may be larger than the model's)."""
        if isinstance(prompt, str):
            return prompt, self._check_ids(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise PromptError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, self._check_ids(prompt)
        raise PromptError(f"a prompt must be a string, token ids or a dict, not {type(prompt).__name__}")

    def _check_ids(self, ids: Any) -> list[int]:
        return list(check_token_ids(ids, self.model_config.arch.vocab_size))

    def check_params(self, params: SamplingParams) -> None:
        """ValueError (a 400) for sampling parameters this model cannot take (before a
        stream starts: the prompt is checked with it in `process`)."""
        error = token_ids_outside(params, self.model_config.arch.vocab_size)
        if error:
            raise PromptError(error)
        self._check_grammar(params)

    def _check_grammar(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # StructuredOutputError: a ValueError

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        text, ids = self.tokenize(prompt)
        max_len = self.model_config.max_model_len
        vocab_size = self.model_config.arch.vocab_size
        check_request(ids, params, max_len, vocab_size, ids_checked=True)  # by `tokenize`
        self._check_grammar(params)
        room = max_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.time() if arrival_time is None else arrival_time
        n = params.n
        group = request_id if n > 1 else None
        core = []
        for i in range(n):
            child_params = params
            if n > 1 and params.seed is not None:  # the i-th sample's seed (wrapped past 2**64 - 1)
                seed = params.seed + i
                child_params = params.clone(seed=seed - (1 << 64) if seed >= 1 << 64 else seed)
            if i > 0 and params.prompt_logprobs is not None:  # the prompt's logprobs come from the first sample
                child_params = child_params.clone(prompt_logprobs=None)
            core.append(
                EngineCoreRequest(
                    request_id=child_request_id(request_id, i, n),
                    prompt_token_ids=ids,
                    sampling_params=child_params,
                    max_tokens=max_tokens,
                    eos_token_ids=self.eos_token_ids,
                    priority=priority,
                    arrival_time=arrival,
                    share_group=group,
                    lora_request=lora_request,
                    ids_checked_vocab=vocab_size,
                )
            )
        return ProcessedRequest(request_id, text, ids, params, core)
