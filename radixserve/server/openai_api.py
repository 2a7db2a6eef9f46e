"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.engine import Engine, GenerateOutput
from radixserve.messages import FinishReason
from radixserve.server.errors import ApiError, sse_error
from radixserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixserve.server.streams import collect, merged_stream

router = APIRouter()

SSE_DONE = "data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"


def engine_of(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


def check_model(engine: Engine, model: str | None) -> None:
    if model is not None and model not in (engine.served_model_name, engine.args.model_path):
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{engine.served_model_name}'",
            param="model",
            code="model_not_found",
        )


def finish_reason_name(finish: FinishReason | None) -> str | None:
    return None if finish is None else finish.type


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(states: list[GenerateOutput], prompt_tokens: int) -> dict[str, Any]:
    completion = sum(s.completion_tokens for s in states)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in states)},
    }


def choice_finish_fields(state: GenerateOutput) -> dict[str, Any]:
    finish = state.finish_reason
    fields: dict[str, Any] = {"finish_reason": finish_reason_name(finish)}
    if finish is not None:
        # SGLang's extra: which stop string or token ended the choice.
        fields["matched_stop"] = finish.matched
    return fields


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    engine = engine_of(request)
    model = {
        "id": engine.served_model_name,
        "object": "model",
        "created": int(request.app.state.started),
        "owned_by": "radixserve",
        "root": engine.args.model_path,
        "max_model_len": engine.context_len,
    }
    return JSONResponse({"object": "list", "data": [model]})


# ---------------------------------------------------------------------- completions


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    engine = engine_of(request)
    check_model(engine, body.model)
    body.refuse_unsupported()
    params = body.sampling_params(body.max_tokens, default_max_tokens=16)
    prompts = [engine.encode(p) if isinstance(p, str) else p for p in body.prompts()]
    # Choice i*n + j is the j-th sample of prompt i, as OpenAI numbers them.
    reqs = [engine.make_request(ids, params) for ids in prompts for _ in range(body.n)]
    echoes = [str(engine.tokenizer.decode(r.input_ids)) if body.echo else "" for r in reqs]
    prompt_tokens = sum(len(reqs[i * body.n].input_ids) for i in range(len(prompts)))
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = engine.served_model_name
    if body.stream:
        return StreamingResponse(
            _stream_completions(
                merged_stream(engine, reqs),
                echoes,
                prompt_tokens,
                body.include_usage,
                response_id,
                created,
                model,
            ),
            media_type=SSE_MEDIA_TYPE,
        )
    states = await collect(engine, reqs, request)
    choices = [
        {"index": i, "text": echoes[i] + s.text, "logprobs": None, **choice_finish_fields(s)}
        for i, s in enumerate(states)
    ]
    return JSONResponse(
        {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(states, prompt_tokens),
        }
    )


async def _stream_completions(
    stream: AsyncIterator[tuple[int, GenerateOutput]],
    echoes: list[str],
    prompt_tokens: int,
    include_usage: bool,
    response_id: str,
    created: int,
    model: str,
) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], usage_value: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = usage_value
        return sse(payload)

    finals: dict[int, GenerateOutput] = {}
    try:
        for index, echo in enumerate(echoes):
            if echo:
                yield chunk([{"index": index, "text": echo, "logprobs": None, "finish_reason": None}])
        async for index, state in stream:
            if not state.delta and not state.finished:
                continue
            yield chunk(
                [{"index": index, "text": state.delta, "logprobs": None, **choice_finish_fields(state)}]
            )
            if state.finished:
                finals[index] = state
        if include_usage:
            yield chunk([], usage(list(finals.values()), prompt_tokens))
    except Exception as exc:
        yield sse_error(*_stream_error(exc))
    yield SSE_DONE


def _stream_error(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, ApiError):
        return exc.status, exc.message
    return 500, f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------- chat


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    engine = engine_of(request)
    check_model(engine, body.model)
    body.refuse_unsupported()
    messages = [m.template_dict() for m in body.messages]
    prompt = engine.encode_chat(messages, **(body.chat_template_kwargs or {}))
    # Without max_tokens a chat may use the rest of the context; the scheduler clips to it.
    params = body.sampling_params(body.requested_max_tokens, default_max_tokens=engine.context_len)
    reqs = [engine.make_request(prompt, params) for _ in range(body.n)]
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = engine.served_model_name
    prompt_tokens = len(reqs[0].input_ids)
    if body.stream:
        return StreamingResponse(
            _stream_chat(
                merged_stream(engine, reqs),
                len(reqs),
                prompt_tokens,
                body.include_usage,
                response_id,
                created,
                model,
            ),
            media_type=SSE_MEDIA_TYPE,
        )
    states = await collect(engine, reqs, request)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": s.text},
            "logprobs": None,
            **choice_finish_fields(s),
        }
        for i, s in enumerate(states)
    ]
    return JSONResponse(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(states, prompt_tokens),
        }
    )


async def _stream_chat(
    stream: AsyncIterator[tuple[int, GenerateOutput]],
    num_choices: int,
    prompt_tokens: int,
    include_usage: bool,
    response_id: str,
    created: int,
    model: str,
) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], usage_value: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = usage_value
        return sse(payload)

    finals: dict[int, GenerateOutput] = {}
    try:
        # OpenAI's first delta of each choice names the role and carries no text.
        for index in range(num_choices):
            yield chunk(
                [{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            )
        async for index, state in stream:
            if state.delta:
                yield chunk([{"index": index, "delta": {"content": state.delta}, "finish_reason": None}])
            if state.finished:
                finals[index] = state
                yield chunk([{"index": index, "delta": {}, **choice_finish_fields(state)}])
        if include_usage:
            yield chunk([], usage(list(finals.values()), prompt_tokens))
    except Exception as exc:
        yield sse_error(*_stream_error(exc))
    yield SSE_DONE
