"""Structured outputs (xgrammar): the bitmask path against asking the matcher token by token,
constrained generation offline (JSON schema, JSON object, regex, choice, EBNF; with async
scheduling, preemption and unconstrained neighbours), and through the OpenAI server."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch
from server_utils import start_server

from llmserve import LLM, SamplingParams, StructuredOutputsParams
from llmserve.config import TINY_MODEL_DIR
from llmserve.engine.structured_output import StructuredOutputs, allowed_tokens, apply_grammar_masks
from llmserve.sampling_params import MAX_STRUCTURED_SPEC_CHARS, SamplingParamsError

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "name": {"type": "string", "maxLength": 12},
    },
    "required": ["answer", "score", "name"],
    "additionalProperties": False,
}
REGEX = r"\d{3}-[a-z]{2}"


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"answer", "score", "name"}, value
    assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9 and len(value["name"]) <= 12


class _Row:  # what apply_grammar_masks reads of a request
    def __init__(self, matcher):
        self.matcher = matcher


def test_bitmask_equals_the_matcher_asked_token_by_token():
    structured = StructuredOutputs(str(TINY_MODEL_DIR), 4096)
    matcher = structured.matcher(StructuredOutputsParams(json=SCHEMA), [2])
    free = structured.matcher(StructuredOutputsParams(regex=REGEX), [2])
    for _step in range(4):  # at the start and after a few accepted tokens
        logits = torch.zeros(3, 4096)
        apply_grammar_masks(logits, [_Row(matcher), _Row(None), _Row(free)])
        assert torch.isfinite(logits[1]).all()  # an unconstrained row is untouched
        for row, m in ((0, matcher), (2, free)):
            fast = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
            assert fast == allowed_tokens(m, 4096) and fast
        for m, row in ((matcher, 0), (free, 2)):
            assert m.accept_token(min(set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())))


@pytest.fixture(scope="module")
def llm():
    return LLM(
        str(TINY_MODEL_DIR), max_model_len=256, block_size=8, num_gpu_blocks_override=60, admission_reserve_tokens=0
    )  # admissions that fill the blocks, so that requests preempt


def generate(llm, spec: StructuredOutputsParams, n: int = 4, max_tokens: int = 120, **kw):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=spec, **kw)
              for s in range(n)]  # fmt: skip
    return [o.outputs[0] for o in llm.generate(["Describe a list in Python:"] * n, params, use_tqdm=False)]


def test_json_schema(llm):
    for out in generate(llm, StructuredOutputsParams(json=SCHEMA)):
        assert out.finish_reason == "stop", out.text
        check_schema(out.text)


def test_json_schema_given_as_text(llm):
    (out,) = generate(llm, StructuredOutputsParams(json=json.dumps(SCHEMA)), n=1)
    check_schema(out.text)


def test_regex_choice_and_grammar(llm):
    for out in generate(llm, StructuredOutputsParams(regex=REGEX)):
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    seen = set()
    for out in generate(llm, StructuredOutputsParams(choice=["yes", "no", "maybe"]), n=8):
        assert out.finish_reason == "stop" and out.text in ("yes", "no", "maybe")
        seen.add(out.text)
    assert len(seen) > 1  # sampling still chooses among what is allowed
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    for out in generate(llm, StructuredOutputsParams(grammar=grammar)):
        assert out.finish_reason == "stop" and re.fullmatch(r"\(\d(\+\d)*\)", out.text), out.text


def test_min_tokens_does_not_fight_the_grammar(llm):
    """min_tokens bans EOS, but a finished grammar allows only EOS: the grammar decides."""
    for out in generate(llm, StructuredOutputsParams(choice=["yes", "no"]), n=3, min_tokens=5):
        assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_a_slow_compile_does_not_hold_other_requests_and_can_be_aborted(llm):
    core = llm.core
    real = core.structured.matcher

    def slow(*args, **kwargs):
        __import__("time").sleep(0.5)
        return real(*args, **kwargs)

    core.structured.matcher = slow
    try:
        params = [
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        ]
        outs = llm.generate(["Describe a list in Python:"] * 2, params, use_tqdm=False)  # fmt: skip
        assert len(outs[0].outputs[0].token_ids) == 8 and re.fullmatch(REGEX, outs[1].outputs[0].text)
        from llmserve.engine.request import EngineCoreRequest, RequestStatus

        core.add_request(EngineCoreRequest("compiling", [1, 5, 9], params[1], 20, (2,)))
        # it waits in the scheduler's queue, which passes it over: the step schedules nothing
        assert core.scheduler.requests["compiling"].status == RequestStatus.WAITING_FOR_GRAMMAR
        assert core.step().outputs == [] and core.stats().num_waiting == 1
        assert core.has_unfinished() and core.abort_requests(["compiling"]) == ["compiling"]
        assert not core.has_unfinished() and core.kv.pool.num_used == 0
    finally:
        core.structured.matcher = real


def test_a_spec_that_fails_in_the_core_finishes_its_request_with_the_reason(llm):
    """A request sent to the core directly (no front to compile its spec first): the compile
    fails on the core's grammar threads, and the request ends with the reason, once."""
    from llmserve.engine.request import EngineCoreRequest

    core = llm.core
    bad = SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    assert core.add_request(EngineCoreRequest("bad-spec", [1, 5, 9], bad, 5, (2,))) is None
    outputs = []
    while core.has_unfinished():
        outputs += core.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad-spec", "abort")] and outputs[0].error
    assert "bad-spec" not in core.scheduler.requests and core.kv.pool.num_used == 0


def test_json_object_is_an_object_when_it_finishes(llm):
    finished = 0
    for out in generate(llm, StructuredOutputsParams(json_object=True), n=6, max_tokens=200):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
            finished += 1
        else:
            assert out.finish_reason == "length" and out.text.startswith("{")
    assert finished >= 2


def test_constrained_and_free_requests_together_under_preemption(llm):
    """60 blocks of 8 tokens cannot hold 12 requests of ~130 tokens: requests are preempted
    and recomputed while their grammars hold their state."""
    specs = [StructuredOutputsParams(regex=REGEX), None, StructuredOutputsParams(json=SCHEMA)] * 4
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120 if s else 100, structured_outputs=s,
                             ignore_eos=s is None) for i, s in enumerate(specs)]  # fmt: skip
    outs = llm.generate(["Describe a list in Python: " * 4] * len(specs), params, use_tqdm=False)
    for spec, o in zip(specs, outs):
        c = o.outputs[0]
        if spec is None:
            assert len(c.token_ids) == 100 and c.finish_reason == "length"
        elif spec.regex:
            assert re.fullmatch(REGEX, c.text)
        else:
            check_schema(c.text)
    assert llm.core.scheduler.num_preemptions > 0


def test_bad_specs_are_refused_before_the_engine(llm):
    with pytest.raises(ValueError, match="invalid structured output \\(regex\\)"):
        generate(llm, StructuredOutputsParams(regex="(unclosed"), n=1)
    with pytest.raises(ValueError, match="invalid structured output \\(json\\)"):
        generate(llm, StructuredOutputsParams(json={"type": "nonsense"}), n=1)
    for bad in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"choice": [""]}, {"regex": ""}, {"json": 3}):
        with pytest.raises(SamplingParamsError):
            StructuredOutputsParams(**bad)
    # size: the limit itself is accepted, one character more is not, for every kind of constraint
    limit = MAX_STRUCTURED_SPEC_CHARS
    assert StructuredOutputsParams(regex="a" * limit).size == limit
    assert StructuredOutputsParams(choice=["ab"] * (limit // 2)).size == limit
    for kind, value in (
        ("regex", "a" * (limit + 1)),
        ("grammar", "b" * (limit + 1)),
        ("choice", ["c"] * (limit + 1)),
        ("json", '"' + "d" * (limit - 1) + '"'),
        ("json", {"description": "e" * limit}),
    ):
        with pytest.raises(SamplingParamsError, match=f"the {kind} constraint is [0-9,]+ characters long; at most"):
            StructuredOutputsParams(**{kind: value})
    deep: dict = {}
    for _ in range(5000):
        deep = {"items": deep}
    with pytest.raises(SamplingParamsError, match="cannot be read: RecursionError"):
        StructuredOutputsParams(json=deep)
    assert not llm.core.has_unfinished()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    srv = start_server([str(TINY_MODEL_DIR), "--max-model-len", "512", "--served-model-name", "tiny"], str(log))
    yield srv
    srv.stop()


def test_openai_client_response_format_and_guided_fields(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Is a list mutable?"}], max_tokens=100, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    )  # fmt: skip
    assert chat.choices[0].finish_reason == "stop"
    check_schema(chat.choices[0].message.content)
    done = client.completions.create(model="tiny", prompt="Answer:", max_tokens=10,
                                      extra_body={"guided_choice": ["alpha", "beta"]})  # fmt: skip
    assert done.choices[0].text in ("alpha", "beta")
    done = client.completions.create(model="tiny", prompt="Code:", max_tokens=20,
                                      extra_body={"structured_outputs": {"regex": REGEX}})  # fmt: skip
    assert re.fullmatch(REGEX, done.choices[0].text)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True,
        extra_body={"guided_regex": "[a-z]{3,6}!"},
    )  # fmt: skip
    assert re.fullmatch("[a-z]{3,6}!", "".join(c.choices[0].delta.content or "" for c in stream if c.choices))


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_deeply_nested_schema_is_served(server):
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                   json={"prompt": "x", "max_tokens": 4, "guided_json": _nested(300)})  # fmt: skip
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("body,message", [
    ({"guided_regex": "(unclosed"}, "invalid structured output (regex)"),
    ({"guided_json": {"type": "nonsense"}}, "invalid structured output (json)"),
    ({"response_format": {"type": "xml"}}, "response_format type"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "one output constraint"),
    ({"structured_outputs": {"foo": 1}}, "structured_outputs is an object of"),
    ({"structured_outputs": "json"}, None),
    ({"response_format": "json"}, None),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"guided_choice": []}, "choice"),
    ({"guided_choice": "yes"}, None),
    ({"structured_outputs": {"json_object": "no"}}, "json_object must be true or false"),
    ({"logit_bias": {"1_0": 5}}, "logit_bias keys"),
    ({"logit_bias": {"99999": 5}}, "logit_bias token ids"),
    ('{"guided_json": ' + '{"type": "object", "properties": {"a": ' * 5000 + '{}' + '}}' * 5000 + '}', None),
    ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                                       for i in range(2000)}}}, "at most 262,144"),
    ({"guided_choice": ["x" * 1000] * 300}, "the choice constraint is 300,000 characters long"),
])  # fmt: skip
def test_bad_constraints_get_a_400(server, body, message):
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "x"}]})):  # fmt: skip
        for stream in (False, True):  # a streamed request is refused before its stream starts
            if isinstance(body, str):  # JSON text too deep for this side's json module
                head = json.dumps({**base, "max_tokens": 5, "stream": stream})[:-1]
                r = httpx.post(server.base_url + path, content=head + ", " + body[1:],
                               headers={"content-type": "application/json"})  # fmt: skip
            else:
                r = httpx.post(server.base_url + path, json={**base, "max_tokens": 5, "stream": stream, **body})
            assert r.status_code == 400, r.text
            assert message is None or message in r.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
