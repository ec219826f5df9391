"""Structured outputs: grammars that constrain sampling (xgrammar).

A request's spec (JSON schema, any JSON object, regex, choice or EBNF grammar) is compiled
once per distinct spec (cached) into a grammar over the model's vocabulary; each request
gets a matcher that follows its own output. Before sampling, the matcher's bitmask of
allowed next tokens sets every other logit to -inf; after, the sampled token advances it;
a matcher that reaches the end of its grammar finishes the request ("stop"). The matcher
needs the previous token before the next step is sampled, so such requests turn off the
overlap of async scheduling (as penalties do).

The reference for the mask is `allowed_tokens` (ask the matcher token by token); the test
compares it with the bitmask path.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

    from llmserve.engine.request import Request


class StructuredOutputError(ValueError):
    """A spec that does not compile; the message says why."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a dependency of the serve extra
        raise StructuredOutputError("structured outputs need the package xgrammar (pip install xgrammar)") from exc
    return xgrammar


def _clean(exc: Exception) -> str:
    """xgrammar's messages start with a time stamp and a C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\] [^ ]+:\d+: ", "", text)


_REGEX_SPECIAL = set("\\^$.|?*+()[]{}/")
CACHE_BYTES = 256 << 20  # compiled grammars kept per process


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (only regex syntax escaped: xgrammar warns
    about escapes such as a space's that Python's re.escape writes)."""
    return "(" + "|".join("".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c) for c in choices) + ")"


class StructuredOutputs:
    """A grammar compiler over one model's vocabulary (built on first use, cache bounded);
    the engine core's, and the front's to check specs with."""

    def __init__(self, tokenizer_dir: str, vocab_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                from llmserve.tokenizer import load_tokenizer

                xgr = _xgrammar()
                tokenizer = load_tokenizer(self.tokenizer_dir)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                                     cache_limit_bytes=CACHE_BYTES)  # fmt: skip
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        try:
            if spec.json is not None:
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if spec.json_object:  # OpenAI's JSON mode: an object, not any JSON value
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_regex(choice_regex(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for bad specs
            raise StructuredOutputError(f"invalid structured output ({spec.kind}): {_clean(exc)}") from None

    def matcher(self, spec: StructuredOutputsParams, stop_token_ids: list[int]) -> xgr.GrammarMatcher:
        """A matcher for one request; the request's own end-of-sequence ids end the grammar."""
        return _xgrammar().GrammarMatcher(self.compile(spec), override_stop_tokens=list(stop_token_ids))


@functools.cache
def _batch_matcher():
    return _xgrammar().BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) - 1)))


@dataclass(slots=True)
class GrammarMask:
    """The tokens each constrained row's grammar allows next: xgrammar's bitmask over the rows
    of a batch, and which rows are constrained. Plain data: filled on the core side (where the
    matchers live), applied by the sampler."""

    bitmask: torch.Tensor  # [rows, ceil(vocab / 32)] int32
    rows: list[int]


def grammar_mask(requests: list[Request], vocab_size: int) -> GrammarMask | None:
    """Fill the bitmask from the requests' matchers (None: no request has a grammar)."""
    rows = [i for i, r in enumerate(requests) if getattr(r, "matcher", None) is not None]
    if not rows:
        return None
    bitmask = _xgrammar().allocate_token_bitmask(len(requests), vocab_size)
    if len(rows) == 1:
        requests[rows[0]].matcher.fill_next_token_bitmask(bitmask, rows[0])
    else:  # ~0.5 ms a request at a 128k vocabulary: several threads (xgrammar releases the GIL)
        _batch_matcher().batch_fill_next_token_bitmask([requests[i].matcher for i in rows], bitmask, rows)
    return GrammarMask(bitmask, rows)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask | None) -> None:
    """Set the logits of tokens the rows' grammars forbid next to -inf."""
    if mask is None:
        return
    bitmask = mask.bitmask
    if logits.device.type != "cpu":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=mask.rows)


def apply_grammar_masks(logits: torch.Tensor, requests: list[Request], mask: GrammarMask | None = None) -> None:
    """`mask` when given (the engine's path: filled on the core side), else one filled from the
    requests' own matchers (requests used directly, as in the tests)."""
    apply_grammar_mask(logits, mask if mask is not None else grammar_mask(requests, logits.shape[-1]))


def allowed_tokens(matcher: xgr.GrammarMatcher, vocab_size: int) -> set[int]:
    """Reference: the tokens the matcher accepts next, asked one by one (slow; tests)."""
    allowed = set()
    for token in range(vocab_size):
        if matcher.accept_token(token):
            allowed.add(token)
            matcher.rollback(1)
    return allowed
