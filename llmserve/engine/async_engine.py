"""`AsyncEngine`: the asyncio front of an engine core running in its own process.

    engine = AsyncEngine.from_engine_args(EngineArgs(model=...))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
        print(out.outputs[0].text)

Each request gets its own queue; outputs are cumulative, so a slow consumer simply sees
fewer, larger updates. Leaving the `async for` early (or cancelling the task) aborts the
request in the core, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from llmserve.config import EngineArgs, EngineConfig
from llmserve.engine.core_client import EngineDeadError
from llmserve.engine.dp_front import make_core_client
from llmserve.engine.input_processor import InputProcessor, PromptType
from llmserve.engine.ipc import Kind, UtilityCall, UtilityResult
from llmserve.engine.output_processor import IterationStats, OutputProcessor, RequestFailedError
from llmserve.engine.request import EngineCoreOutputs, SchedulerStats
from llmserve.lora_request import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, config: EngineConfig, start_timeout: float = 900.0) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(config.model_config.tokenizer)
        self.input_processor = InputProcessor(config.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats = SchedulerStats()
        self._stats_listeners: list = []
        self._death_listeners: list[Callable[[str], None]] = []
        self._utility_waiters: dict[int, asyncio.Future] = {}  # by call id: concurrent calls each get theirs
        self._call_ids = itertools.count()
        self.sleeping = False  # the core gave its device memory back (sleep); the next request wakes it
        self._sleep_lock = asyncio.Lock()
        self.dead_reason: str | None = None
        self.client = make_core_client(config, self._on_message, self._on_dead, start_timeout)  # (DP: several)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncEngine:
        return cls(args.create_engine_config(), **kwargs)

    # -- public API -----------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.dead_reason is not None or not self.client.alive

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    def stats(self) -> SchedulerStats:
        """The core's latest scheduler stats (running, waiting, KV usage, cache, preemptions)."""
        return self._stats

    def stats_by_rank(self) -> list[SchedulerStats]:
        """Each engine core's latest stats (data parallelism: one per core; else the one core's)."""
        by_rank = getattr(self.client, "stats_by_rank", None)
        return by_rank() if by_rank is not None else [self._stats]

    def add_stats_listener(self, listener: Callable[[IterationStats], None]) -> None:
        """Call `listener(IterationStats)` in the event loop after each batch of outputs."""
        self._stats_listeners.append(listener)

    def add_death_listener(self, listener: Callable[[str], None]) -> None:
        self._death_listeners.append(listener)

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(self.dead_reason or "engine core process is not running")

    async def check_params(self, sampling_params: SamplingParams) -> None:
        """ValueError for what the engine would refuse; grammars compile in a worker thread
        (then `generate` finds them cached)."""
        await asyncio.to_thread(self.input_processor.check_params, sampling_params)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes. Bad input raises a
        ValueError before anything is queued. `arrival_time` (wall clock; default: now) is
        where time to first token and end-to-end latency start, e.g. when the HTTP request came."""
        self._bind_loop()
        await self.check_health()
        if self.sleeping or self._sleep_lock.locked():  # a request never fails for sleep: it waits for the wake
            await self.wake_up()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.process(
            request_id, prompt, sampling_params or SamplingParams(), priority, arrival_time, lora_request
        )
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(processed)
        finished = False
        try:
            self.output_processor.mark_sent(request_id, time.time())  # before: the core may read it at once
            for core_req in processed.core_requests:
                self.client.send(Kind.ADD, core_req)
            while not finished:
                item = await queue.get()
                while not queue.empty() and not isinstance(item, BaseException):
                    item = queue.get_nowait()  # outputs are cumulative: keep the newest
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(RequestFailedError(f"request {request_id} was aborted"))

    async def reset_prefix_cache(self) -> bool:
        return await self._utility("reset_prefix_cache")

    # -- sleep mode: the engine's device memory given back while idle ----------------------
    async def sleep(self, level: int = 1) -> bool:
        """Put an idle engine to sleep (level 1: weights to host memory; 2: weights dropped);
        False if requests are in flight. A request arriving later wakes it first."""
        async with self._sleep_lock:
            if self.num_unfinished:
                return False
            asleep = await self._utility("sleep", level, timeout=600)
            self.sleeping = self.sleeping or bool(asleep)
            return asleep

    async def wake_up(self) -> None:
        async with self._sleep_lock:
            if self.sleeping:
                await self._utility("wake_up", timeout=600)
                self.sleeping = False

    async def is_sleeping(self) -> bool:
        return self.sleeping

    async def add_lora(self, lora: LoRARequest) -> None:
        """Read and check a LoRA adapter in the engine core (ValueError with the reason)."""
        error = await self._utility("add_lora", lora, timeout=300)
        if error is not None:
            raise ValueError(error)

    async def remove_lora(self, name: str) -> None:
        await self._utility("remove_lora", name)

    async def memory_footprint(self) -> dict:
        """The engine's device memory: `weight_bytes` and `kv_cache_bytes` when awake (also
        while asleep), `device_bytes` it holds now, and its KV block counts."""
        return await self._utility("memory_footprint")

    def shutdown(self) -> None:
        self.client.shutdown()

    # -- plumbing ---------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop.is_closed():
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an AsyncEngine serves one event loop")

    def _abort_now(self, request_id: str) -> None:
        core_ids = self.output_processor.abort(request_id)
        if core_ids and not self.errored:
            self.client.send(Kind.ABORT, core_ids)

    async def _utility(self, name: str, *args: Any, timeout: float = 30.0) -> Any:
        self._bind_loop()
        await self.check_health()
        call = UtilityCall(next(self._call_ids), name, args)
        fut = self._loop.create_future()
        self._utility_waiters[call.call_id] = fut
        try:
            self.client.send(Kind.UTILITY, call)
            result: UtilityResult = await asyncio.wait_for(fut, timeout=timeout)
        finally:
            self._utility_waiters.pop(call.call_id, None)
        if result.error is not None:
            raise RuntimeError(f"engine core utility {name}: {result.error}")
        return result.result

    def _on_message(self, kind: Kind, payload: Any) -> None:
        """From the client's reader thread: hop onto the event loop."""
        if kind is Kind.OUTPUTS:
            self._stats = payload.stats  # set here, in arrival order, so it is never stale
            if not payload.outputs:
                return  # no request state touched: no need to hop
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # no event loop to deliver to (outputs of requests whose loop is gone)
        try:
            loop.call_soon_threadsafe(self._handle_message, kind, payload)
        except RuntimeError:  # the loop closed just now
            pass

    def _handle_message(self, kind: Kind, payload: Any) -> None:
        if kind is Kind.UTILITY_RESULT:
            fut = self._utility_waiters.get(payload.call_id)
            if fut is not None and not fut.done():
                fut.set_result(payload)
            return
        if kind is not Kind.OUTPUTS:
            return
        outputs: EngineCoreOutputs = payload
        processed = self.output_processor.process(outputs.outputs, core_time=outputs.timestamp)
        if processed.core_ids_to_abort and not self.errored:
            self.client.send(Kind.ABORT, processed.core_ids_to_abort)
        for request_id, error in processed.errors.items():
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(RequestFailedError(error))
        for out in processed.request_outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for listener in self._stats_listeners:
            listener(processed.stats)

    def _on_dead(self, reason: str) -> None:
        self.dead_reason = reason
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, reason)

    def _fail_all(self, reason: str) -> None:
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        for listener in self._death_listeners:
            listener(reason)
