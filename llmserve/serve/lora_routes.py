"""vLLM's runtime LoRA routes, on `llmserve serve --enable-lora --enable-runtime-lora-updating`
(off by default: 404, as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING). They are admin routes:
the admin key (or the API key), unless the operator chose `--allow-unauthenticated-lora-updating`.

- POST /v1/load_lora_adapter {"lora_name", "lora_path"}: the engine core reads and checks the
  adapter now (a bad one is a 400 with the reason, and nothing changes); from then on a
  request whose "model" is `lora_name` runs with it.
- POST /v1/unload_lora_adapter {"lora_name"}: no new request can name it; requests already
  running with it finish with it (nothing accepted is lost).
Adapters are listed in /v1/models with their base model as `parent`. `lora_path` is resolved
once (symlinks and '..'); with `--lora-roots` it must lie inside one, and the core opens that
resolved folder and checks what it opened (llmserve/lora/folder.py), so a symlink swapped in
after the check cannot lead it elsewhere. Every unusable path (missing, not a folder, outside
the roots, unreadable, no adapter files) gets the same 400: the answer tells nothing of what
exists. Each load and unload is logged with the client's address (never a key).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse

from llmserve.lora.errors import UNUSABLE_PATH_MESSAGE
from llmserve.lora.folder import inside_roots
from llmserve.lora_request import LoRARequest
from llmserve.openai.errors import APIError
from llmserve.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from llmserve.serve.state import ServerState

logger = logging.getLogger(__name__)


def add_lora_routes(app: FastAPI, admin: Callable[..., Any]) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load(req: LoadLoRAAdapterRequest, request: Request, s: ServerState = Depends(admin)) -> str:
        engine = s.require_engine()
        who = _client(request)
        if req.lora_name in s.adapters or req.lora_name in s.config.served_model_names:
            raise APIError(400, f"the LoRA adapter {req.lora_name!r} has already been loaded", code="already_loaded",
                           param="lora_name")  # fmt: skip
        roots = tuple(s.config.lora_roots)
        resolved = os.path.realpath(req.lora_path)  # the one resolution: the core reads this folder
        if roots and not inside_roots(resolved, roots):
            logger.warning("LoRA adapter %r not loaded for %s: %r resolves to %r, outside --lora-roots",
                           req.lora_name, who, req.lora_path, resolved)  # fmt: skip
            raise _unusable()
        try:
            await engine.add_lora(LoRARequest(req.lora_name, s.lora_ids + 1, resolved, roots))
        except ValueError as exc:  # the core logged the reason of an unusable path
            logger.warning("LoRA adapter %r not loaded for %s from %r: %s", req.lora_name, who, resolved, exc)
            raise APIError(400, str(exc), code="invalid_lora_adapter", param="lora_path") from None
        s.add_adapter(req.lora_name, resolved, roots)
        logger.info("LoRA adapter %r loaded from %r (asked as %r) for %s", req.lora_name, resolved, req.lora_path, who)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload(req: UnloadLoRAAdapterRequest, request: Request, s: ServerState = Depends(admin)) -> str:
        engine = s.require_engine()
        if req.lora_name not in s.adapters:
            raise APIError(404, f"the LoRA adapter {req.lora_name!r} is not loaded", code="lora_not_found",
                           param="lora_name")  # fmt: skip
        del s.adapters[req.lora_name]
        await engine.remove_lora(req.lora_name)
        logger.info("LoRA adapter %r unloaded for %s", req.lora_name, _client(request))
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."


def _unusable() -> APIError:
    return APIError(400, UNUSABLE_PATH_MESSAGE, code="invalid_lora_adapter", param="lora_path")


def _client(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "an unknown client"
