"""The one check of what a request asks, against the model it goes to.

The front (`InputProcessor`) runs it before a request is sent, so a bad prompt is the
caller's 400 with the reason; the engine core runs the same function on what arrives (a
core can be driven directly, or by a front of another version), and answers a failure
with an error output instead of raising inside the step loop.
"""

from __future__ import annotations

from array import array

import numpy as np

from llmserve.sampling_params import SamplingParams, token_ids_outside


class PromptError(ValueError):
    """A prompt the engine cannot take; the message says what to change."""


class PromptTooLongError(PromptError):
    pass


def check_token_ids(ids: object, vocab_size: int) -> list[int]:
    """`ids` as a list of token ids inside the vocabulary, or PromptError. The usual list (plain
    ints, all inside) is checked by C-level passes (the types as a set, then min and max): a
    request was checked three times on its way in, and 1000 x 1,024-token prompts took 0.6 s of
    host time before the first step (2 cores) with a Python loop per token. Anything else
    takes `check_token_ids_reference`, which finds the reason. From `_ARRAY_CHECK_TOKENS` on, the
    bounds come from one copy into a C array (0.25 against 0.39 ms at 7,680 tokens; no faster at
    1,024)."""
    if isinstance(ids, list) and (not ids or (set(map(type, ids)) == {int} and _inside(ids, vocab_size))):
        return ids
    return check_token_ids_reference(ids, vocab_size)


_ARRAY_CHECK_TOKENS = 2048


def _inside(ids: list[int], vocab_size: int) -> bool:
    """Every id (a plain int) in [0, vocab_size)."""
    if len(ids) < _ARRAY_CHECK_TOKENS:
        return min(ids) >= 0 and max(ids) < vocab_size
    try:
        values = np.frombuffer(array("q", ids), dtype=np.int64)
    except OverflowError:  # past int64: certainly outside
        return False
    return bool(values.min() >= 0 and values.max() < vocab_size)


def check_token_ids_reference(ids: object, vocab_size: int) -> list[int]:
    """`check_token_ids` one token at a time: ints (bool excluded, int subclasses taken), each inside."""
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise PromptError("prompt_token_ids must be a list of integers")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_request(ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                  ids_checked: bool = False) -> None:  # fmt: skip
    """PromptError (PromptTooLongError for length) unless the model can take this prompt
    with these sampling parameters: not empty, leaving room for one generated token, ids
    and every token id in the parameters inside the vocabulary (`ids_checked`: the ids
    already passed `check_token_ids` against this vocabulary)."""
    if not ids:
        raise PromptError("the prompt is empty: give at least one token")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens, but this model's maximum context length "
            f"(max_model_len) is {max_model_len} and at least one token must be generated: "
            "shorten the prompt or raise --max-model-len"
        )
    if not ids_checked:
        check_token_ids(ids, vocab_size)
    error = token_ids_outside(params, vocab_size)
    if error:
        raise PromptError(error)
