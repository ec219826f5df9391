"""A request's prompt as the replica will see it, in token ids, for kv_aware routing.

Completions: token ids as sent, or the text through the model's tokenizer (special tokens added,
as the server's `encode` does); a batch routes by its first prompt. Chat: the messages (tool
calls and results, tools, `chat_template_kwargs`, `add_generation_prompt`) through the model's
chat template, as `llmserve serve` renders them (openai/chat.py). Whatever cannot be read this
way (a malformed body, the replica's own `--chat-template`, content parts that are not text) is
None: the request is routed by load, and the replica gives its own answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.kv_block_hash import block_hashes


@dataclass
class KVPrompt:
    """A prompt's token ids, and its block hashes per block size (computed once each)."""

    token_ids: list[int]
    lora: str | None = None
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def hashes(self, block_size: int) -> list[int]:
        found = self._hashes.get(block_size)
        if found is None:
            found = self._hashes[block_size] = block_hashes(self.token_ids, block_size, self.lora)
        return found


def _ids(value) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    return None


def completion_ids(payload: dict, tokenizer) -> list[int] | None:
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and (isinstance(prompt[0], str) or isinstance(prompt[0], list)):
        prompt = prompt[0]  # a batch: its prompts run as separate requests; the first decides
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt) if tokenizer is not None else None
    return _ids(prompt)


def chat_ids(payload: dict, tokenizer) -> list[int] | None:
    if tokenizer is None:
        return None
    from pydantic import ValidationError

    from llmserve.chat_template import ChatTemplateError, render_chat
    from llmserve.openai.protocol import ChatCompletionRequest
    from llmserve.openai.tools import template_messages, template_tools

    try:
        req = ChatCompletionRequest.model_validate(payload)
        tools = template_tools(req.tools) if req.tools else None
        return render_chat(tokenizer, template_messages(req.messages), req.add_generation_prompt,
                           req.chat_template_kwargs, tools)  # fmt: skip
    except (ValidationError, ChatTemplateError, ValueError, TypeError):
        return None


def prompt_ids(payload: dict, path: str, tokenizer) -> list[int] | None:
    """The prompt's token ids, or None when they cannot be known here (`tokenizer` None: text
    cannot be read)."""
    if path == "/v1/chat/completions":
        return chat_ids(payload, tokenizer)
    if path == "/v1/completions":
        return completion_ids(payload, tokenizer)
    return None
