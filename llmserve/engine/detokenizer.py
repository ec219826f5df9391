"""Incremental detokenization and stop strings, one generated sequence at a time.

Decoding only a short window of tokens per step keeps it O(1) per token; a few prompt
tokens lead the window so tokenizers that drop a word's leading space at the start of
a decode (SentencePiece) still get it right. Text that could be the start of a stop
string is held back from streaming until it is clear either way.

A prompt may end inside a character (token ids cut in the middle of an emoji's bytes). The
output is what the generated tokens add to the decoded prompt: the prompt's text up to its
last whole character (`stable_prompt_text`) plus the output is the decode of all the tokens,
the straddling character completed by the output. The window then starts at the prompt's last
whole character, and the text the prompt's incomplete tail decodes to with the first output
tokens is dropped from the output up to that character.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

try:  # the Rust streaming decoder: about 1 us a token instead of two decodes
    from tokenizers.decoders import DecodeStream
except ImportError:  # older tokenizers
    DecodeStream = None

_PROMPT_CONTEXT = 5
_MAX_PARTIAL_TOKENS = 4  # a character is at most 4 bytes: a prompt ends inside one by at most 4 tokens
REPLACEMENT = "\ufffd"  # what a decode shows for bytes that are not (yet) a whole character


def stable_prompt_text(text: str) -> str:
    """A decoded prompt without the replacement characters its incomplete last character
    decodes to: the part of it no output token can change."""
    return text.rstrip(REPLACEMENT)


def _window(tokenizer: PreTrainedTokenizerBase, prompt: list[int], skip_special: bool) -> tuple[list[int], int, int]:
    """The prompt tokens that lead the window: (context, tail, skip). `context` ends at a whole
    character; `tail` of them follow it, a character's first bytes; the first `skip` characters
    the window's decode adds past `context` are the prompt's own (its text before the
    incomplete character, in the tail's first token)."""
    context = list(prompt[-_PROMPT_CONTEXT:])
    if not context:
        return context, 0, 0
    whole = tokenizer.decode(context, skip_special_tokens=skip_special)
    if not whole.endswith(REPLACEMENT):
        return context, 0, 0  # (the usual case: one decode)
    for tail in range(1, min(_MAX_PARTIAL_TOKENS, len(prompt)) + 1):
        context = list(prompt[-(_PROMPT_CONTEXT + tail) :])
        head = tokenizer.decode(context[:-tail], skip_special_tokens=skip_special)
        if not head.endswith(REPLACEMENT):
            whole = tokenizer.decode(context, skip_special_tokens=skip_special)
            return context, tail, max(0, len(stable_prompt_text(whole)) - len(head))
    return context, 0, 0  # bytes that never make a character: nothing to complete


def _make_stream(tokenizer: PreTrainedTokenizerBase, context: list[int], skip_special: bool):
    backend = getattr(tokenizer, "_tokenizer", None)
    if DecodeStream is None or backend is None:
        return None, None
    try:
        return DecodeStream(ids=context, skip_special_tokens=skip_special), backend
    except TypeError:  # a DecodeStream that cannot be primed with the prompt's tail
        return None, None


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop_strings: list[str],
        include_stop_str_in_output: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = stop_strings
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        context, tail, self._skip = _window(tokenizer, list(prompt_token_ids), skip_special_tokens)
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(context) - tail
        self.text = ""
        self._stream, self._backend = _make_stream(tokenizer, context[: self.read_offset], skip_special_tokens)
        if self._stream is not None:
            for token in context[self.read_offset :]:  # the incomplete character's first bytes: no text yet
                self._stream.step(self._backend, token)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string that matched, if one did (the text is
        then cut at it)."""
        start_len = len(self.text)
        if self._stream is not None:  # (every token of every sequence: kept lean)
            ids, step, backend = self.ids, self._stream.step, self._backend
            for token in token_ids:
                ids.append(token)
                chunk = step(backend, token)
                if chunk:
                    if self._skip:
                        self._append(chunk)
                    else:
                        self.text += chunk
                    self.prefix_offset = self.read_offset  # (`_emitted`)
                    self.read_offset = len(ids)
            return self._find_stop(start_len) if self.stop_strings else None
        for token in token_ids:
            self.ids.append(token)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
                self._append(full[len(prefix) :])
                self._emitted()
        return self._find_stop(start_len)

    def _emitted(self) -> None:
        """The tokens so far made text: the window moves past them."""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)

    def flush(self) -> None:
        """The output ended: the text of its last tokens that never made a whole character
        (replacement characters, as a decode of all the tokens shows them)."""
        if len(self.ids) == self.read_offset:
            return
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix):
            self._append(full[len(prefix) :])
        self._emitted()

    def _append(self, chunk: str) -> None:
        """New text, less what of it is still the prompt's (`_window`'s skip)."""
        if self._skip:
            dropped = min(self._skip, len(chunk))
            chunk, self._skip = chunk[dropped:], self._skip - dropped
        self.text += chunk

    def _find_stop(self, new_from: int) -> str | None:
        if not self.stop_strings:
            return None
        found = []
        for stop in self.stop_strings:
            pos = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if pos != -1:
                found.append((pos, stop))
        if not found:
            return None
        pos, stop = min(found)
        self.text = self.text[: pos + len(stop)] if self.include_stop else self.text[:pos]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now: all of it once finished, else minus a possible
        partial stop string at the end."""
        if finished or not self.stop_strings or self.holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
