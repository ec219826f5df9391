"""Triton Python-backend model: streaming text generation on an llmserve AsyncEngine.

Decoupled: each request gets zero or more responses (`text_output` holds the new text
since the previous response, `finish_reason` is set on the last one; `prompt_tokens` and
`completion_tokens` count the tokens so far, as the API server's `usage` counts them) and
then the final flag. Sampling settings come from optional inputs or from request parameters (inputs win).
A request the client cancels is aborted in the engine, which frees its KV blocks.

The engine and its event loop live on a thread of their own, so `execute` only hands
requests over and returns; many requests stream concurrently (continuous batching).
"""

import asyncio
import json
import multiprocessing
import os
import shutil
import sys
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SCALARS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int, "min_tokens": int,
           "min_p": float, "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float}
# an error that is the request's fault starts with this (a client such as the gateway reads it
# as a 400: a stream's errors carry a message only, no status code)
CLIENT_ERROR_MARK = "invalid request: "


def _engine_args(params: dict) -> dict:
    """Engine settings from config.pbtxt parameters (all strings there)."""
    from llmserve.config import EngineArgs

    types = {"max_model_len": int, "max_num_seqs": int, "max_num_batched_tokens": int,
             "block_size": int, "seed": int, "gpu_memory_utilization": float,
             "num_gpu_blocks_override": int, "kv_cache_memory_bytes": int}  # fmt: skip
    args = {"model": params.pop("model_dir")}
    for key, value in params.items():
        if key not in EngineArgs.field_names():
            raise ValueError(f"unknown engine setting {key!r} in config.pbtxt parameters")
        if key in types:
            value = types[key](value)
        elif value in ("true", "false"):
            value = value == "true"
        args[key] = value
    return args


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def render_messages(tokenizer, messages_json: str, tools_json: str | None = None) -> dict:
    """A chat conversation (OpenAI `messages`, as JSON) as token ids, by the model's chat
    template, with the tools (OpenAI function definitions, as JSON) it offers, as the API
    server renders them (assistant tool calls and tool results included)."""
    from llmserve.chat_template import render_chat
    from llmserve.openai.tools import conversation

    messages = json.loads(messages_json)
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("the messages parameter must be a JSON list of {role, content} objects")
    tools = json.loads(tools_json) if tools_json else None
    if tools is not None and not isinstance(tools, list):
        raise ValueError("the tools parameter must be a JSON list of function tools")
    # the template writes BOS; its errors (and a model without one) are ValueErrors: the client's
    return {"prompt_token_ids": render_chat(tokenizer, conversation(messages), True, None, tools)}


def parse_request(request, tokenizer=None):
    """(prompt, SamplingParams keyword arguments, priority) from one Triton request.

    The prompt is `text_input`, or, when the request parameter `messages` holds a JSON chat
    conversation, that conversation through the model's chat template (`text_input` unused)."""
    prompt = _input(request, "text_input")
    if prompt is None or prompt.size != 1:
        raise ValueError("text_input must hold exactly one string")
    params = json.loads(request.parameters() or "{}")
    chat = None
    if isinstance(params.get("messages"), str) and tokenizer is not None:
        tools = params.get("tools") if isinstance(params.get("tools"), str) else None
        chat = render_messages(tokenizer, params["messages"], tools)
    kwargs = {}
    for name, cast in SCALARS.items():
        value = _input(request, name)
        value = params.get(name) if value is None else value[0]
        if value is not None:
            kwargs[name] = cast(value)
    stop = _input(request, "stop")
    if stop is not None:
        kwargs["stop"] = [_text(s) for s in stop]
    elif params.get("stop") is not None:
        kwargs["stop"] = [params["stop"]] if isinstance(params["stop"], str) else list(params["stop"])
    if "ignore_eos" in params:
        kwargs["ignore_eos"] = bool(params["ignore_eos"])
    if isinstance(params.get("logit_bias"), str):  # OpenAI's token id (as text) -> bias
        try:
            kwargs["logit_bias"] = {int(k): float(v) for k, v in json.loads(params["logit_bias"]).items()}
        except (ValueError, TypeError, AttributeError):
            raise ValueError("logit_bias must map token ids (integers) to biases") from None
    if isinstance(params.get("structured_outputs"), str):  # the OpenAI request's constraint fields, as JSON
        from llmserve.openai.protocol import structured_outputs_from

        kwargs["structured_outputs"] = structured_outputs_from(json.loads(params["structured_outputs"]))
    priority = _input(request, "priority")
    priority = int(params.get("priority", 0) if priority is None else priority[0])
    return chat or _text(prompt[0]), kwargs, priority


def _response(text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("prompt_tokens", np.array([prompt_tokens], dtype=np.int32)),
        pb_utils.Tensor("completion_tokens", np.array([completion_tokens], dtype=np.int32)),
    ])  # fmt: skip


class TritonPythonModel:
    def initialize(self, args):
        from llmserve.config import EngineArgs
        from llmserve.engine.async_engine import AsyncEngine

        # inside the backend stub sys.executable is not a Python: the engine core is a
        # spawned process, so point multiprocessing at the environment's interpreter
        python = shutil.which("python3") or shutil.which("python")
        if python and not os.path.basename(sys.executable or "").startswith("python"):
            multiprocessing.set_executable(python)
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.engine = AsyncEngine.from_engine_args(EngineArgs(**_engine_args(params)))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="llmserve-chat", daemon=True)
        self.thread.start()

    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)

    async def _serve(self, request):
        from llmserve.sampling_params import SamplingParams

        sender = request.get_response_sender()
        try:
            prompt, kwargs, priority = parse_request(request, self.engine.tokenizer)
            request_id = uuid.uuid4().hex
            stream = self.engine.generate(prompt, SamplingParams(**kwargs), request_id, priority)
            sent = ""
            async for out in stream:
                if request.is_cancelled():
                    await stream.aclose()  # leaving the generator aborts the request
                    pb_utils.Logger.log_info(f"llmserve chat: request {request_id} cancelled, "
                                             "aborted in the engine")  # fmt: skip
                    break
                completion = out.outputs[0]
                delta, sent = completion.text[len(sent):], completion.text
                if delta or out.finished:
                    finish = (completion.finish_reason or "") if out.finished else ""
                    sender.send(_response(delta, finish, len(out.prompt_token_ids), len(completion.token_ids)))
            sender.send(flags=FINAL)
        except (ValueError, TypeError, KeyError) as exc:  # the request's own fault (bad values, a bad conversation)
            message = f"{CLIENT_ERROR_MARK}{type(exc).__name__}: {exc}"
            code = getattr(pb_utils.TritonError, "INVALID_ARG", None)  # error codes: python backend 23.08 and later
            error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        except Exception as exc:  # noqa: BLE001 - every failure must end the stream
            error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}")
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def finalize(self):
        self.engine.shutdown()  # stops the engine core process and frees its memory
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
