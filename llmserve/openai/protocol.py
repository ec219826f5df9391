"""OpenAI API schemas (plus vLLM's sampling extensions), and their sampling params."""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from llmserve.sampling_params import SamplingParams, StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")  # fmt: skip


def schema_text(schema: dict, what: str = "the JSON schema") -> str:
    """A schema as JSON text (ValueError, a 400, for one too deep or not JSON)."""
    try:
        return json.dumps(schema)
    except (RecursionError, ValueError, TypeError):
        raise ValueError(f"{what} is nested too deeply or is not JSON") from None


def structured_outputs_from(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    """The one output constraint a request asks for, however it asks: OpenAI's
    `response_format`, vLLM's `structured_outputs` or one `guided_*` field (ValueError: a 400).
    Also used where the fields arrive as plain JSON (the Triton chat model)."""
    asked: list[StructuredOutputsParams] = []
    fmt = fields.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(StructuredOutputsParams(json_object=True))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
            asked.append(StructuredOutputsParams(json=schema))
        elif kind != "text":
            raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
    so = fields.get("structured_outputs")
    if so is not None:
        known = {"json", "regex", "choice", "grammar", "json_object"}
        if not isinstance(so, dict) or set(so) - known:
            raise ValueError(f"structured_outputs is an object of {', '.join(sorted(known))}; got {so!r:.200}")
        asked.append(StructuredOutputsParams(**so))
    for key in ("json", "regex", "choice", "grammar"):
        value = fields.get(f"guided_{key}")
        if value is not None:
            asked.append(StructuredOutputsParams(**{key: value}))
    if len(asked) > 1:
        raise ValueError("ask for one output constraint: response_format, structured_outputs or one guided_* field")
    if not asked:
        return None
    if isinstance(asked[0].json, dict):  # a schema travels as JSON text (a deeply nested dict cannot be pickled)
        asked[0].json = schema_text(asked[0].json)
    return asked[0]


# vLLM request fields with an effect this server does not have (beam search, per-token masks,
# truncation): a request naming one is refused rather than served differently
UNSUPPORTED_VLLM_FIELDS = (
    "use_beam_search",
    "length_penalty",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "logits_processors",
)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI's API takes `null` for an optional field as "not given" (clients send
        `"stream": null`); the field's default stands then."""
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if not (v is None and k in fields and not fields[k].is_required() and fields[k].default is not None)}  # fmt: skip
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    # seconds the request may take, from its arrival to its last token (the server's
    # --request-timeout-s caps it); past it the request is aborted: a 504, or an error event.
    # At least a second: a shorter one would stop nearly every request before its first token
    request_timeout_s: float | None = Field(default=None, ge=1)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: each prompt token's logprob and the top k at its position (not streamed, as vLLM)
    prompt_logprobs: int | None = None
    # vLLM's: the prompt's and the output's token ids in the answer (a stream: the prompt's in the
    # first chunk, each chunk's own tokens in it)
    return_token_ids: bool | None = None

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream = true")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_are_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream = true (as in vLLM)")
        return self

    @model_validator(mode="after")
    def _no_unsupported_vllm_fields(self):
        """vLLM's sampling fields this server does not do: refused by name (extra fields are
        allowed, so they would be dropped without a word)."""
        extra = self.model_extra or {}
        given = [name for name in UNSUPPORTED_VLLM_FIELDS if extra.get(name) not in (None, False, [], {})]
        if given:
            raise ValueError(f"not supported by llmserve: {', '.join(given)}")
        return self

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        return structured_outputs_from({k: getattr(self, k) for k in STRUCTURED_FIELDS})

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:  # fmt: skip
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            structured_outputs=self.structured_outputs_params(),
            logit_bias=self._logit_bias(),
        )

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys, that is as strings."""
        if not self.logit_bias:
            return None
        if not all(re.fullmatch(r"[0-9]+", k) for k in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids (non-negative integers)")
        return {int(k): float(v) for k, v in self.logit_bias.items()}


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        # echo with logprobs shows the prompt's tokens' logprobs first (as OpenAI and vLLM)
        echoed = self.logprobs if self.echo and self.logprobs is not None and self.prompt_logprobs is None else None
        return self._sampling_params(max_tokens, self.logprobs, echoed)


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant's earlier thoughts, as a reasoning parser returned them (either name)
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs = true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class _OmitNone(BaseModel):
    """vLLM's optional answer fields (token ids, prompt logprobs): absent unless given."""

    _omit_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_absent_fields(self, handler):
        data = handler(self)
        for key in self._omit_none:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class PromptLogprob(BaseModel):
    """One entry of vLLM's `prompt_logprobs` (its `Logprob`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per prompt token, the first None: {token id: its Logprob} (the prompt's token and the top k)
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # of completion_tokens, those of the thoughts (markers included)


class UsageInfo(_OmitNone):
    _omit_none = ("completion_tokens_details",)

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # with a reasoning parser (chat): how many of the completion's tokens are its thoughts
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_OmitNone):
    _omit_none = ("prompt_logprobs", "prompt_token_ids", "token_ids")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_OmitNone):
    _omit_none = ("reasoning", "reasoning_content")

    role: str = "assistant"
    content: str | None = None
    # with a reasoning parser: the thoughts (vLLM's `reasoning`, and `reasoning_content` as older
    # vLLM and DeepSeek's API name it); absent without one
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_OmitNone):
    _omit_none = ("token_ids",)

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_OmitNone):
    _omit_none = ("prompt_logprobs", "prompt_token_ids")

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # with a reasoning parser: the thoughts' new text (and as reasoning_content)
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler):  # as vLLM: a delta without calls (or thoughts) has no such key
        data = handler(self)
        for key in ("tool_calls", "reasoning", "reasoning_content"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatStreamChoice(_OmitNone):
    _omit_none = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_OmitNone):
    _omit_none = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None  # with messages: counted as the chat request would
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # always a string, as OpenAI's (errors.error_body: one by status when none is named)


class ErrorResponse(BaseModel):
    error: ErrorInfo


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # accepted as vLLM does; the name decides
