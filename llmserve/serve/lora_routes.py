"""vLLM's LoRA adapter routes on `llmserve serve --enable-lora` (admin routes: the admin key).

- POST /v1/load_lora_adapter {"lora_name", "lora_path"}: the engine core reads and checks the
  adapter now (a bad one is a 400 with the reason, and nothing changes); from then on a
  request whose "model" is `lora_name` runs with it.
- POST /v1/unload_lora_adapter {"lora_name"}: no new request can name it; requests already
  running with it finish with it (nothing accepted is lost).
Adapters are listed in /v1/models with their base model as `parent`. With `--lora-roots`, a
load names a folder inside one of them, or it is refused (403) before anything is read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse

from llmserve.lora_request import LoRARequest
from llmserve.openai.errors import APIError
from llmserve.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from llmserve.serve.state import ServerState


def inside_roots(path: str, roots: list[str]) -> bool:
    """Whether `path`, with symlinks and '..' resolved, is one of `roots` (resolved) or inside one."""
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, root]) == root for root in roots)


def add_lora_routes(app: FastAPI, admin: Callable[..., Any]) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load(req: LoadLoRAAdapterRequest, s: ServerState = Depends(admin)) -> str:
        engine = s.require_engine()
        if s.config.lora_roots and not inside_roots(req.lora_path, s.config.lora_roots):
            raise APIError(403, "lora_path is outside the folders this server loads adapters from (--lora-roots)",
                           code="path_not_allowed", param="lora_path")  # fmt: skip
        if req.lora_name in s.adapters or req.lora_name in s.config.served_model_names:
            raise APIError(400, f"the LoRA adapter {req.lora_name!r} has already been loaded", code="already_loaded",
                           param="lora_name")  # fmt: skip
        try:
            await engine.add_lora(LoRARequest(req.lora_name, s.lora_ids + 1, req.lora_path))
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_lora_adapter", param="lora_path") from None
        s.add_adapter(req.lora_name, req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload(req: UnloadLoRAAdapterRequest, s: ServerState = Depends(admin)) -> str:
        engine = s.require_engine()
        if req.lora_name not in s.adapters:
            raise APIError(404, f"the LoRA adapter {req.lora_name!r} is not loaded", code="lora_not_found",
                           param="lora_name")  # fmt: skip
        del s.adapters[req.lora_name]
        await engine.remove_lora(req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
