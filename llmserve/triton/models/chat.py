"""Triton Python-backend model: OpenAI chat and completions on an llmserve AsyncEngine.

A request holds one OpenAI request body as JSON (`request`) and the endpoint it is for
(`endpoint`: /v1/chat/completions, the default, or /v1/completions). The answer is what
`llmserve serve` answers, made by the same code (llmserve/openai/): decoupled responses,
each with `status` (the HTTP status) and `response` (UTF-8 text):
- a stream (`"stream": true`): one response per server-sent event (`data: {...}`), the
  last `data: [DONE]`, then the final flag;
- otherwise one response holding the whole JSON body; a refused request (a bad field, a
  prompt too long) answers its OpenAI error JSON with status 400 (404, 503).
So a client such as the gateway forwards the bytes as they come. With the parameter
`enable_sleep_mode` "true" the model also takes the control endpoints of
llmserve/placement/engine_control.py (/sleep, /wake_up, /is_sleeping, /footprint), which a
placement controller uses to share the GPU between models. A request the client
cancels is aborted in the engine, which frees its KV blocks.

The engine and its event loop live on a thread of their own, so `execute` only hands
requests over and returns; many requests stream concurrently (continuous batching).
"""

import server_path  # noqa: F401, I001 (first: PYTHONPATH into sys.path; see server_path.py)
import asyncio
import contextlib
import json
import multiprocessing
import os
import shutil
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Model parameters of the chat model's own (not engine settings):
#   stream_sends: thread (default) | loop -- who sends streamed responses (llmserve/triton/stream_sends.py)
#   switch_interval_s -- the stub's GIL switch interval (Python's 5 ms by default); a send waits on
#   Triton with the GIL released and gets it back from a busy thread only at a switch
#   request_timeout_s -- the longest a request may run (openai/deadline.py): 504, or a stream's last error event
#   reasoning_parser -- deepseek_r1 | qwen3: chat replies' thoughts apart from the answer (llmserve/reasoning)
CHAT_PARAMETERS = (
    "tool_call_parser",
    "reasoning_parser",
    "lora_modules",
    "switch_interval_s",
    "stream_sends",
    "request_timeout_s",
)


def _engine_args(params: dict) -> dict:
    """Engine settings from config.pbtxt parameters (all strings there), typed as EngineArgs
    declares them."""
    import typing

    from llmserve.cli_args import base_type
    from llmserve.config import EngineArgs

    hints = typing.get_type_hints(EngineArgs)
    args = {"model": params.pop("model_dir")}
    for key in CHAT_PARAMETERS:  # the chat model's, not the engine's
        params.pop(key, None)
    for key, value in params.items():
        if key not in EngineArgs.field_names() or key == "usage_context":
            raise ValueError(f"unknown engine setting {key!r} in config.pbtxt parameters")
        kind = base_type(hints[key])
        if kind is bool:
            value = value == "true"
        elif kind in (int, float):
            value = kind(value)
        args[key] = value
    return args


def lora_modules(spec: str) -> dict:
    """The `lora_modules` parameter ("name=path,name=path": LoRA adapters a request may name as
    its model; the engine needs enable_lora) as LoRARequests."""
    from llmserve.lora_request import LoRARequest, parse_lora_module

    pairs = [parse_lora_module(item) for item in spec.split(",") if item.strip()]
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(pairs)}


def _text(request, name: str, default: str | None = None) -> str | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)
    if value.size != 1:
        raise ValueError(f"{name} must hold exactly one string")
    return value[0].decode("utf-8") if isinstance(value[0], bytes) else str(value[0])


def _number(request, name: str) -> float:
    """An optional FP32 input of one value (0 when absent)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return 0.0
    value = tensor.as_numpy().reshape(-1)
    if value.size != 1 or not np.isfinite(value[0]) or value[0] < 0:
        raise ValueError(f"{name} must hold one number >= 0")
    return float(value[0])


def _response(status: int, text: str):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("status", np.array([status], dtype=np.int32)),
        pb_utils.Tensor("response", np.array([text.encode("utf-8")], dtype=np.object_)),
    ])  # fmt: skip


def instance_gpu(kind: str, device_id: str, visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for a model instance: Triton's GPU `device_id` for a GPU instance
    (mapped through an existing CUDA_VISIBLE_DEVICES list), None for a CPU instance."""
    if kind != "GPU":
        return None
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    index = int(device_id)
    if devices is None:
        return str(index)
    if not 0 <= index < len(devices):
        raise ValueError(f"GPU instance on device {index}, but CUDA_VISIBLE_DEVICES lists {len(devices)}: {visible}")
    return devices[index]


class TritonPythonModel:
    def initialize(self, args):
        from llmserve.config import EngineArgs
        from llmserve.engine.async_engine import AsyncEngine

        # inside the backend stub sys.executable is not a Python: the engine core is a
        # spawned process, so point multiprocessing at the environment's interpreter
        python = shutil.which("python3") or shutil.which("python")
        if python and not os.path.basename(sys.executable or "").startswith("python"):
            multiprocessing.set_executable(python)
        visible = instance_gpu(args.get("model_instance_kind", ""), args.get("model_instance_device_id", "0"),
                               os.environ.get("CUDA_VISIBLE_DEVICES"))  # fmt: skip
        if visible is not None:  # a KIND_GPU instance: its engine core (a spawned process) sees that GPU alone
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.tool_call_parser = params.get("tool_call_parser") or None
        self.reasoning_parser = params.get("reasoning_parser") or None
        if self.reasoning_parser is not None:  # a wrong name fails the model's load, not each request
            from llmserve.reasoning import reasoning_parser

            reasoning_parser(self.reasoning_parser)
        self.request_timeout_s = float(params["request_timeout_s"]) if params.get("request_timeout_s") else None
        if params.get("switch_interval_s"):  # the stub's process alone
            sys.setswitchinterval(float(params["switch_interval_s"]))
        self.sleep_mode = params.get("enable_sleep_mode") == "true"
        self.name = config.get("name", "chat")
        self.adapters = lora_modules(params.get("lora_modules", ""))  # a request's "model" may name one
        from llmserve.triton.stream_sends import stream_sends

        # streams' responses: from a thread of their own (a stream's waiting events together), or from the loop
        self.sends = stream_sends(
            params.get("stream_sends") or "thread",
            lambda text: _response(200, text),
            FINAL,
            lambda message: pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
        )
        self.engine = AsyncEngine.from_engine_args(EngineArgs(**_engine_args(params), usage_context="api_server"))
        from llmserve.metrics import EngineMetrics
        from llmserve.triton.inflight import InFlightWatch

        self.metrics = EngineMetrics(self.engine, self.name)  # read by the gateway (endpoint /metrics)
        self.watch = InFlightWatch()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="llmserve-chat", daemon=True)
        self.thread.start()
        self.watching = asyncio.run_coroutine_threadsafe(self.watch.run(), self.loop)
        import llmserve.openai.calls  # noqa: F401 - what the first request needs, loaded (and frozen) now
        from llmserve.heap import freeze_startup_objects

        # this stub process is the model's alone: its start-up heap (torch, transformers, the
        # engine's client) out of the collector's scans, whose full passes stalled every stream
        freeze_startup_objects(f"Triton model {self.name}")

    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)

    async def _serve(self, request):
        from llmserve.openai.calls import CHAT, openai_call
        from llmserve.openai.errors import APIError, error_body

        sender = request.get_response_sender()
        streaming = False
        try:
            body = (_text(request, "request") or "").encode("utf-8")
            endpoint = _text(request, "endpoint", CHAT)
            keepalive_s = _number(request, "keepalive_s")
        except ValueError as exc:
            sender.send(_response(400, json.dumps(error_body(400, str(exc)))), flags=FINAL)
            return
        if endpoint.startswith("/") and not endpoint.startswith("/v1/"):
            await self._control(sender, endpoint, body)
            return
        # watched while in flight: a client that left cancels this task, whose cleanup aborts
        # the request in the engine; keep-alives let Triton's HTTP server notice one that left
        entry = self.watch.add(request, asyncio.current_task(), keepalive_s, lambda: self._keepalive(sender, streaming))
        try:
            reply = await openai_call(self.engine, endpoint, body, self.name, self.tool_call_parser, self.adapters,
                                      self.request_timeout_s, self.reasoning_parser)  # fmt: skip
            if reply.error is not None:
                sender.send(_response(reply.status, json.dumps(reply.error)), flags=FINAL)
            elif reply.events is not None:
                streaming = True
                await self._stream(entry, sender, reply.events)
            else:
                try:
                    whole = await reply.body
                except APIError as exc:  # the request's own end (its deadline passed): its error
                    sender.send(_response(exc.status, json.dumps(error_body(exc.status, exc.message, exc.code))),
                                flags=FINAL)  # fmt: skip
                else:
                    sender.send(_response(200, json.dumps(whole)), flags=FINAL)
        except asyncio.CancelledError:  # its client left (the watcher): aborted in the engine already
            what = "a stream" if streaming else "a request"
            pb_utils.Logger.log_info(f"llmserve chat: {what} was cancelled, aborted in the engine")
            if streaming:
                self.sends.put(sender, None, last=True)
            else:
                with contextlib.suppress(Exception):  # the call is gone already
                    sender.send(flags=FINAL)
        except Exception as exc:  # noqa: BLE001 - every failure must end the stream
            if streaming:  # after the events already queued: an error event and [DONE], as llmserve serve ends one
                from llmserve.openai.errors import sse_error

                try:
                    self.sends.put(sender, sse_error(500, f"internal error: {type(exc).__name__}"))
                    self.sends.put(sender, "data: [DONE]", last=True)
                    return
                except Exception:  # noqa: BLE001 - the sends failed too (stream_sends: loop): end it below
                    pass
            error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}")
            try:
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            except Exception:  # noqa: BLE001 - the stream is gone (its client went away)
                pass
        finally:
            self.watch.remove(entry)

    def _keepalive(self, sender, streaming: bool) -> None:
        """Write a keep-alive to a quiet call (a stream's goes through its sends, in order)."""
        from llmserve.openai.sse_events import KEEPALIVE

        if streaming:
            self.sends.put(sender, KEEPALIVE)
        else:
            sender.send(_response(200, KEEPALIVE))

    async def _control(self, sender, endpoint: str, body: bytes) -> None:
        from llmserve.openai.errors import error_body
        from llmserve.placement.engine_control import control_call

        if endpoint == "/metrics":  # the engine's Prometheus page (vLLM's names), for the gateway
            sender.send(_response(200, self.metrics.page()), flags=FINAL)
            return
        if not self.sleep_mode:
            status, answer = 404, error_body(404, f"{endpoint}: this model's sleep mode is off (enable_sleep_mode)")
        else:
            try:
                status, answer = await control_call(self.engine, endpoint, body)
            except Exception as exc:  # noqa: BLE001 - the caller gets the failure, the model keeps serving
                status, answer = 500, error_body(500, f"{endpoint} failed: {type(exc).__name__}: {exc}")
        sender.send(_response(status, json.dumps(answer)), flags=FINAL)

    async def _stream(self, entry, sender, events) -> None:
        watch = self.watch
        try:
            async for event in events:
                now = time.monotonic()
                if watch.due(entry, now):  # asked at most every POLL_S: a round trip to Triton
                    break
                self.sends.put(sender, event)
                entry.sent(now)
        finally:
            await events.aclose()  # leaving the stream early aborts the request in the engine
        if entry.cancelled:
            raise asyncio.CancelledError()  # as if the watcher had cancelled it while it waited
        self.sends.put(sender, None, last=True)

    def finalize(self):
        self.watching.cancel()
        self.engine.shutdown()  # stops the engine core process and frees its memory
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.sends.close()
