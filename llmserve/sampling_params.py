"""Sampling parameters, with vLLM's names, defaults and checks."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_N = 128  # samples per request, OpenAI's limit: each is a request of its own in the engine
MAX_STOP_STRINGS = 256  # each is looked for in the new text of every step (OpenAI allows 4)


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; the message names it and its valid range."""


# a bigger constraint is refused: its grammar's compile time grows faster than its text (160
# tools' schemas of 40 optional properties, 195k characters: 2.5 s on one core of the CPU machine)
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's names): exactly one of a JSON schema (`json`, a dict or
    its JSON text), any JSON object (`json_object`), a regular expression (`regex`), one of
    several strings (`choice`) or an EBNF grammar (`grammar`)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        _check(isinstance(self.json_object, bool), "json_object must be true or false")
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        _check(len(given) == 1, f"structured outputs take exactly one of json, json_object, regex, choice, "
               f"grammar; got {', '.join(given) or 'none'}")  # fmt: skip
        _check(self.json is None or isinstance(self.json, (dict, str)), "the JSON schema must be an object")
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex != ""), "regex must not be empty")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar != ""),
               "grammar must not be empty")  # fmt: skip
        _check(
            self.choice is None or (isinstance(self.choice, list) and len(self.choice) > 0
                                    and all(isinstance(c, str) and c for c in self.choice)),
            "choice must be a non-empty list of non-empty strings",
        )  # fmt: skip
        size = self.size
        _check(size <= MAX_STRUCTURED_SPEC_CHARS, f"the {self.kind} constraint is {size:,} characters long; at most "
               f"{MAX_STRUCTURED_SPEC_CHARS:,} (its grammar would take too long to compile)")  # fmt: skip

    @property
    def size(self) -> int:
        """Characters of the constraint's text (the schema as JSON, the regex, the grammar,
        the choices together): what its grammar's compile time grows with."""
        if isinstance(self.json, dict):
            try:
                return len(json.dumps(self.json))
            except (RecursionError, TypeError, ValueError) as exc:
                raise SamplingParamsError(f"the JSON schema cannot be read: {type(exc).__name__}") from None
        text = self.json if self.json is not None else self.regex if self.regex is not None else self.grammar
        return len(text) if text is not None else sum(map(len, self.choice or []))

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token (vLLM's; the first has none)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if all(isinstance(t, int) for t in self.stop_token_ids):  # once each (a mask per step); else refused below
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}")
        _check(self.seed is None or -(2**63) <= self.seed < 2**64, "seed must be a 64-bit integer")
        _check(0.0 <= self.temperature < math.inf, f"temperature must be a finite number >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.top_k < 2**62, f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            0.0 < self.repetition_penalty < math.inf,
            f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
        )
        _check(all(s for s in self.stop_strings), "stop strings must not be empty")
        _check(len(self.stop_strings) <= MAX_STOP_STRINGS,
               f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop_strings)}")  # fmt: skip
        _check(
            self.logit_bias is None or all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 and isinstance(b, (int, float))
                and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()),
            "logit_bias maps token ids (non-negative integers) to biases in [-100, 100]",
        )  # fmt: skip
        _check(
            all(isinstance(t, int) and 0 <= t < 2**62 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers (token ids)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone(self, **changes: object) -> SamplingParams:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "stop_strings"}
        values.update(changes)
        return SamplingParams(**values)


def token_ids_outside(params: SamplingParams, vocab_size: int) -> str | None:
    """Why the token ids these params name (logit_bias, stop_token_ids) do not fit a
    vocabulary of `vocab_size`, or None. Checked by the front (a 400) and the engine core."""
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        return f"logit_bias token ids must be in [0, {vocab_size})"
    if params.stop_token_ids and max(params.stop_token_ids) >= vocab_size:
        return f"stop_token_ids must be in [0, {vocab_size})"
    return None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SamplingParamsError(message)
