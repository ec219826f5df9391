"""Structured outputs after the thoughts: a request's constraint (a JSON schema, a regex, a tool
call's schema...) applies to the answer, not to the reasoning before it.

The constraint becomes one grammar: free thoughts (any text without `</think>`), `</think>`,
blanks, then the request's own grammar. A template that closed the thoughts in the prompt
(enable_thinking false) leaves the constraint as it is; where the output may or may not think
(`qwen3` with nothing in the prompt) the thoughts are optional and open with `<think>`. A
regex, choice or grammar that itself holds `</think>` spells out the thoughts and is kept whole.
"""

from __future__ import annotations

import re

from llmserve.reasoning import END, State
from llmserve.sampling_params import StructuredOutputsParams

# any text without "</think>": the marker's proper prefixes ("open", followed by another "<" or
# the end) and "<" runs that leave the marker ("close"); checked against `"</think>" in s`
THOUGHT_RULES = r"""thought ::= ([^<] | thought_open* thought_close)* thought_open*
thought_open ::= "<" ("/" ("t" ("h" ("i" ("n" "k"?)?)?)?)?)?
thought_close ::= "<" ([^/<] | "/" ([^t<] | "t" ([^h<] | "h" ([^i<] | "i" ([^n<] | "n" ([^k<] | "k" [^><]))))))
"""

_HEAD = {
    "thinking": 'root ::= "<think>"? thought "</think>" [ \\n]*\n',
    "either": 'root ::= ("<think>" thought "</think>" [ \\n]*)?\n',
}


def thoughts_grammar(state: State):
    """The xgrammar Grammar of the thoughts part."""
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(_HEAD[state] + THOUGHT_RULES)


def _answer_grammar(spec: StructuredOutputsParams):
    """The request's constraint as an xgrammar Grammar, compiled as the engine compiles it."""
    import json

    import xgrammar as xgr

    from llmserve.engine.structured_output import choice_regex

    if spec.json is not None:
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    if spec.json_object:
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.regex is not None:
        return xgr.Grammar.from_regex(spec.regex)
    if spec.choice is not None:
        return xgr.Grammar.from_regex(choice_regex(spec.choice))
    return xgr.Grammar.from_ebnf(spec.grammar)


def after_thoughts(spec: StructuredOutputsParams, state: State) -> StructuredOutputsParams:
    """`spec` preceded by the thoughts (ValueError, a 400, for a spec that does not compile)."""
    if state == "answering":
        return spec
    if state == "harmony":
        from llmserve.reasoning.harmony import CHANNEL

        texts = (spec.regex or "", spec.grammar or "", *(spec.choice or []))
        if any(CHANNEL in re.sub(r"\\(.)", r"\1", text) for text in texts):  # a regex escapes the "|"s
            return spec  # it spells out the harmony messages itself
        raise ValueError(
            "structured outputs (and tool_choice required or named) are not supported with the "
            "gpt_oss reasoning parser yet, unless the constraint spells out the harmony messages"
        )
    if any(END in text for text in (spec.regex or "", spec.grammar or "", *(spec.choice or []))):
        return spec  # a constraint that writes the end marker itself spells out the thoughts too
    import xgrammar as xgr

    try:
        answer = _answer_grammar(spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for bad specs
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        reason = re.sub(r"^\[[\d:]+\] [^ ]+:\d+: ", "", reason)  # xgrammar's time stamp and C++ source line
        raise ValueError(f"invalid structured output ({spec.kind}): {reason}") from None
    return StructuredOutputsParams(grammar=str(xgr.Grammar.concat(thoughts_grammar(state), answer)))
