"""A conversation as token ids, through the tokenizer's chat template (shared by the
OpenAI server's chat endpoint, `/tokenize` and the offline `LLM.chat`)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class ChatTemplateError(ValueError):
    """The model's chat template rejected the conversation."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template."""


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
    template_kwargs: dict | None = None, tools: list[dict] | None = None,
) -> list[int]:  # fmt: skip
    """Token ids of the conversation (OpenAI-shaped message dicts) as the model's chat
    template writes it, with the tools (OpenAI-shaped function definitions) it offers."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError("this model has no chat template: use completions (plain prompts) instead")
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    except Exception as exc:  # a template may reject a conversation (e.g. role order)
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
    return tokenizer.encode(text, add_special_tokens=False)
