"""`EngineClient`: the one engine interface `serve/` and `triton/` depend on.

llmserve's `AsyncEngine` implements it; an adapter over another engine (vLLM's async
engine, for one) can implement it too, and the server above does not change.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

from transformers import PreTrainedTokenizerBase

from llmserve.config import ModelConfig
from llmserve.engine.input_processor import PromptType
from llmserve.engine.output_processor import IterationStats
from llmserve.engine.request import SchedulerStats
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    model_config: ModelConfig
    tokenizer: PreTrainedTokenizerBase

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def check_params(self, sampling_params: SamplingParams) -> None:
        """Raise ValueError for parameters this engine cannot take (e.g. a structured-output
        spec that does not compile), without blocking the event loop; servers call it before
        a streamed response starts, so such errors are a 400 rather than an error event."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None: ...

    @property
    def errored(self) -> bool: ...

    @property
    def num_unfinished(self) -> int: ...

    def stats(self) -> SchedulerStats: ...

    def add_stats_listener(self, listener: Callable[[IterationStats], None]) -> None: ...

    def add_death_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` in the event loop once, if the engine dies (after every
        request in flight has been failed with that reason)."""

    async def sleep(self, level: int = 1) -> bool:
        """Give the device memory back while idle (False: requests in flight); requests wake it."""
        ...

    async def wake_up(self) -> None: ...

    async def is_sleeping(self) -> bool: ...

    def shutdown(self) -> None: ...
