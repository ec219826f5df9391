"""In-process AsyncEngines as the placement's actuator (one engine per model name)."""

from __future__ import annotations

from collections.abc import Mapping

from llmserve.placement.footprint import Footprint


class EngineActuator:
    def __init__(self, engines: Mapping[str, object]) -> None:
        self.engines = dict(engines)  # name -> AsyncEngine

    async def sleep(self, name: str, level: int) -> bool:
        return await self.engines[name].sleep(level)

    async def wake(self, name: str) -> None:
        await self.engines[name].wake_up()

    async def footprint(self, name: str) -> Footprint:
        return Footprint.from_row(await self.engines[name].memory_footprint())

    async def is_sleeping(self, name: str) -> bool:
        return await self.engines[name].is_sleeping()
