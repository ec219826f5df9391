"""A token's own bytes, as OpenAI's logprobs give them (`bytes`; a completions token that is not
whole UTF-8 as "bytes:\\xNN..."): a token that is part of a character has that character's
bytes, not those of U+FFFD its decode shows, so the bytes of a reply's tokens rebuild its text.

From the token's piece in the vocabulary: a byte-level BPE piece (GPT-2's alphabet of 256
printable characters, one per byte) maps back byte by byte; a SentencePiece piece is its text
with U+2581 for a space, or `<0xNN>` for a byte (byte fallback); any other tokenizer falls back
to the token's decode.
"""

from __future__ import annotations

import functools
import json
import re

from transformers import PreTrainedTokenizerBase

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (as `bytes_to_unicode` builds it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_types(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The types of the fast tokenizer's decoders (a Sequence's members too); empty if unknown."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return set()
    return {spec.get("type")} | {d.get("type") for d in spec.get("decoders", ())}


class TokenBytes:
    """Token id -> its bytes, each token's made once."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        kinds = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in kinds
        self._sentencepiece = bool(kinds & {"ByteFallback", "Metaspace"})
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}))
        self._cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        found = self._cache.get(token)
        if found is None:
            found = self._cache[token] = self._bytes(token)
        return found

    def _bytes(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return self.tokenizer.decode([token]).encode()
        if token in self._added:  # special and added tokens: their text
            return piece.encode()
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in piece)
        if self._sentencepiece:
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode()
        return self.tokenizer.decode([token]).encode()


@functools.lru_cache(maxsize=8)
def token_bytes_of(tokenizer: PreTrainedTokenizerBase) -> TokenBytes:
    """The one `TokenBytes` of a tokenizer (the server's)."""
    return TokenBytes(tokenizer)


def token_text(data: bytes) -> str:
    """A completions token as OpenAI writes it: its text, or "bytes:\\xNN..." when its bytes are
    not whole UTF-8 (part of a character)."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
