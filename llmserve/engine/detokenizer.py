"""Incremental detokenization and stop strings, one generated sequence at a time.

Decoding only a short window of tokens per step keeps it O(1) per token; a few prompt
tokens lead the window so tokenizers that drop a word's leading space at the start of
a decode (SentencePiece) still get it right. Text that could be the start of a stop
string is held back from streaming until it is clear either way.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

try:  # the Rust streaming decoder: about 1 us a token instead of two decodes
    from tokenizers.decoders import DecodeStream
except ImportError:  # older tokenizers
    DecodeStream = None

_PROMPT_CONTEXT = 5


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
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self._stream, self._backend = _make_stream(tokenizer, context, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string that matched, if one did (the text is
        then cut at it)."""
        start_len = len(self.text)
        if self._stream is not None:
            for token in token_ids:
                chunk = self._stream.step(self._backend, token)
                if chunk:
                    self.text += chunk
            return self._find_stop(start_len)
        for token in token_ids:
            self.ids.append(token)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        return self._find_stop(start_len)

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
