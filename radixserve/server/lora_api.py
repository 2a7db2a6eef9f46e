"""The LoRA adapter routes (--enable-lora), SGLang's: /load_lora_adapter and /unload_lora_adapter.
Each answers {"success": true, "loaded_adapters": {name: path}}; a refusal is a 400 with the
reason (a bad adapter loads nothing; an adapter in use by requests in flight stays loaded)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from radixserve.server.json_values import ParsedJsonRoute
from radixserve.server.openai_api import engine_of

router = APIRouter(route_class=ParsedJsonRoute)


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    # SGLang's option to keep an adapter in its slot for good; slots here follow use (ignored).
    pinned: bool = False


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str


def _loaded(adapters: dict[str, str]) -> JSONResponse:
    reply: dict[str, Any] = {"success": True, "loaded_adapters": adapters}
    return JSONResponse(reply)


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraBody, request: Request) -> JSONResponse:
    engine = engine_of(request)
    return _loaded(await asyncio.to_thread(engine.load_lora_adapter, body.lora_name, body.lora_path))


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraBody, request: Request) -> JSONResponse:
    engine = engine_of(request)
    return _loaded(await asyncio.to_thread(engine.unload_lora_adapter, body.lora_name))
