"""Embedding routes: OpenAI's /v1/embeddings and the native /encode, on an embedding model."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from radixserve.runtime.engine import Engine
from radixserve.server.errors import ApiError
from radixserve.server.json_values import ParsedJsonRoute
from radixserve.server.limits import check_batch, check_token_ids
from radixserve.server.openai_api import check_model, engine_of
from radixserve.server.streams import collect

router = APIRouter(route_class=ParsedJsonRoute)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    # The official client asks for base64 unless told otherwise, and decodes it itself.
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EncodeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None


def _prompts(
    engine: Engine, value: str | list[str] | list[int] | list[list[int]], name: str
) -> tuple[list[list[int]], bool]:
    """Token ids per input, and whether a single input was given."""
    if isinstance(value, str):
        return [engine.tokenize(value)], True
    if not value:
        raise ApiError(400, f"{name} is empty", param=name)
    if all(isinstance(x, int) for x in value):
        check_token_ids(value, name)
        return [list(value)], True  # type: ignore[arg-type]
    check_batch(len(value), name)
    if all(isinstance(x, list) for x in value):
        for index, row in enumerate(value):
            check_token_ids(row, f"{name}[{index}]")
    if all(isinstance(x, str) for x in value):
        return [engine.tokenize(x) for x in value], False  # type: ignore[arg-type]
    if all(isinstance(x, list) for x in value):
        return [list(x) for x in value if isinstance(x, list)], False
    raise ApiError(400, f"{name} must be a string, a list of strings, or token ids", param=name)


async def _embed(
    engine: Engine, prompts: list[list[int]], request: Request, rids: list[str | None]
) -> list[dict[str, Any]]:
    pairs = zip(prompts, rids, strict=True)
    reqs = [engine.requests.build(ids, None, rid, embed=True) for ids, rid in pairs]
    return [state.to_dict() for state in await collect(engine, reqs, request)]


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    engine = engine_of(request)
    if check_model(engine, body.model) is not None:
        raise ApiError(400, "LoRA adapters serve generation, not embeddings", param="model")
    if body.dimensions is not None:
        raise ApiError(
            400, "dimensions is not supported: embeddings keep the model's size", param="dimensions"
        )
    prompts, _ = _prompts(engine, body.input, "input")
    results = await _embed(engine, prompts, request, [None] * len(prompts))
    data = []
    for index, result in enumerate(results):
        vector: list[float] = result["embedding"]
        encoded: list[float] | str = vector
        if body.encoding_format == "base64":
            encoded = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({"object": "list", "data": data, "model": engine.served_model_name, "usage": usage})


@router.post("/encode")
async def encode(body: EncodeBody, request: Request) -> JSONResponse:
    """SGLang's native embedding route: one result per input, {"embedding", "meta_info"}."""
    engine = engine_of(request)
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "pass exactly one of text or input_ids")
    prompts, single = _prompts(engine, body.text if body.text is not None else body.input_ids or [], "text")
    rid = body.rid
    if isinstance(rid, list):
        if len(rid) != len(prompts):
            raise ApiError(400, "rid must have one entry per input", param="rid")
        rids: list[str | None] = list(rid)
    else:
        rids = [rid] if single else [f"{rid}-{i}" if rid else None for i in range(len(prompts))]
    results = await _embed(engine, prompts, request, rids)
    return JSONResponse(results[0] if single else results)
