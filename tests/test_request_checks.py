"""The fast token-id check against its one-token-at-a-time reference, on good and bad prompts."""

from __future__ import annotations

import enum

import numpy as np
import pytest

from llmserve.engine.request_checks import PromptError, check_token_ids, check_token_ids_reference

pytestmark = pytest.mark.unit

V = 100


class Tok(enum.IntEnum):
    A = 5


CASES = [
    [], [0], [99], list(range(V)), [3, 4, 5] * 1000,
    [100], [-1], [1, 2, 10**30], [1, -(10**30)],
    [True, 2], [1, False], [1.0, 2], [1, "2"], [1, None], [Tok.A, 7], [np.int64(3)],
    (1, 2), "12", None, {1: 2}, np.array([1, 2]),
    # long enough for the C-array bounds check
    [7] * 3000, [99] * 2999 + [100], [0] * 2999 + [-1], [5] * 2999 + [2**63], [5] * 2999 + [-(2**63) - 1],
    [5] * 2999 + [True], [5] * 2999 + [Tok.A],
]  # fmt: skip


def outcome(check, ids):
    try:
        return ("ok", check(ids, V))
    except PromptError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize("ids", CASES, ids=range(len(CASES)))
def test_fast_check_equals_the_reference(ids):
    fast, ref = outcome(check_token_ids, ids), outcome(check_token_ids_reference, ids)
    assert fast[0] == ref[0] and (fast[0] == "error" or fast[1] is ids)
    assert fast == ref if fast[0] == "error" else True


def test_reasons_name_the_bad_token():
    assert outcome(check_token_ids, [1, 2, 100, -5])[1] == "prompt token id 100 is outside the vocabulary [0, 100)"
    assert outcome(check_token_ids, [1, True])[1] == "prompt_token_ids must be a list of integers"
    assert outcome(check_token_ids, [Tok.A, 1]) == ("ok", [Tok.A, 1])  # an int subclass is still an int
