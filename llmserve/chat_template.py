"""A conversation as token ids, through the tokenizer's chat template (shared by the
OpenAI server's chat endpoint, `/tokenize` and the offline `LLM.chat`)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class ChatTemplateError(ValueError):
    """The model's chat template rejected the conversation."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template."""


# apply_chat_template's own arguments, which chat_template_kwargs must not set
_RESERVED_KWARGS = frozenset(
    {
        "chat_template",
        "tools",
        "documents",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "conversation",
    }
)


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
    template_kwargs: dict | None = None, tools: list[dict] | None = None,
) -> list[int]:  # fmt: skip
    """Token ids of the conversation (OpenAI-shaped message dicts) as the model's chat
    template writes it, with the tools (OpenAI-shaped function definitions) it offers."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError("this model has no chat template: use completions (plain prompts) instead")
    kwargs = dict(template_kwargs or {})
    if taken := sorted(set(kwargs) & _RESERVED_KWARGS):
        # these are apply_chat_template's own arguments, not template variables: a client's
        # `chat_template` would run its own Jinja code on the server (vLLM refuses it too)
        raise ChatTemplateError(f"chat_template_kwargs may hold template variables only, not {', '.join(taken)}")
    if tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    except Exception as exc:  # a template may reject a conversation (e.g. role order)
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
    return tokenizer.encode(text, add_special_tokens=False)
