"""Engine logprobs in OpenAI's shapes: completions' (tokens, token_logprobs, top_logprobs,
text_offset), chat's (content entries with their bytes) and vLLM's `prompt_logprobs`.

A token is written by its own bytes (token_bytes.py): completions' `tokens` and `top_logprobs`
keys are a token's text, or "bytes:\\xNN..." when it is part of a character; chat's `bytes` are
the token's bytes. `text_offset` is where each token starts in the choice's text: the characters
that the tokens before it complete (a token that ends inside a character starts where that
character does). A logprob of -inf (JSON has none) is written as -9999.0, as vLLM does.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from llmserve.openai.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, TopLogprob
from llmserve.openai.token_bytes import TokenBytes, token_text
from llmserve.outputs import CompletionOutput, Logprob

_FLOOR = -9999.0
_PRIMER_TOKENS = 3  # a character's first bytes lie in at most 3 tokens before the one that ends it


def _finite(value: float) -> float:
    return max(value, _FLOOR)


class TextOffsets:
    """Where each of a choice's tokens starts in its text, token after token (a stream's chunks
    go on from the last): the characters the tokens before it complete."""

    def __init__(self, token_bytes: TokenBytes, start: int = 0, before: Sequence[int] = ()) -> None:
        """The first token starts at `start`, after the tokens `before` (a prompt's: their bytes may
        begin a character the first token completes)."""
        self.token_bytes = token_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.decoder.decode(
            b"".join(map(token_bytes, before[-_PRIMER_TOKENS:]))
        )  # (only an unfinished character stays)
        self.offset = start

    def next(self, data: bytes) -> int:
        """The offset of the token of bytes `data`."""
        at = self.offset
        self.offset += len(self.decoder.decode(data))
        return at


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None],
                        offsets: TextOffsets) -> CompletionLogprobs:  # fmt: skip
    """The logprobs of `token_ids` (entry i: {token id: Logprob} of token i, None where there are
    none: a prompt's first token), placed in the text by `offsets`."""
    lp = CompletionLogprobs()
    token_bytes = offsets.token_bytes
    for token, entry in zip(token_ids, entries):
        data = token_bytes(token)
        lp.tokens.append(token_text(data))
        lp.text_offset.append(offsets.next(data))
        if entry is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        lp.token_logprobs.append(_finite(entry[token].logprob))
        lp.top_logprobs.append({token_text(token_bytes(t)): _finite(e.logprob) for t, e in entry.items()})
    return lp


def chat_logprobs(out: CompletionOutput, start: int, top_n: int, token_bytes: TokenBytes) -> ChatLogprobs:
    """OpenAI's chat logprobs: each token's, and the `top_n` most likely at its position (the
    engine's entry also holds the sampled token, which is among them only if it ranks so)."""
    content = []
    for token, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
        chosen = entry[token]
        top = sorted(
            ((t, e) for t, e in entry.items() if e.rank is not None and e.rank <= top_n), key=lambda x: x[1].rank
        )
        content.append(
            ChatTokenLogprob(
                token=chosen.decoded_token or "",
                logprob=_finite(chosen.logprob),
                bytes=list(token_bytes(token)),
                top_logprobs=[
                    TopLogprob(token=e.decoded_token or "", logprob=_finite(e.logprob), bytes=list(token_bytes(t)))
                    for t, e in top
                ],  # fmt: skip
            )
        )
    return ChatLogprobs(content=content)


def prompt_logprobs_json(prompt_logprobs: Sequence[dict[int, Logprob] | None] | None,
                         ) -> list[dict[int, PromptLogprob] | None] | None:  # fmt: skip
    """vLLM's `prompt_logprobs` of an answer: per prompt token (the first None), {token id: Logprob}."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {t: PromptLogprob(logprob=_finite(e.logprob), rank=e.rank, decoded_token=e.decoded_token)
             for t, e in entry.items()}
            for entry in prompt_logprobs]  # fmt: skip
