"""/tokenize and /detokenize, with vLLM's request and response shapes.

/tokenize takes a `prompt` (text; `add_special_tokens` defaults to true) or chat `messages` and
optional `tools` (through the chat template, as /v1/chat/completions renders them;
`add_special_tokens` defaults to false, the template holding any the model wants) and answers the
ids, their count, the served context length and, with `return_token_strs`, each id's token string.
/detokenize turns `tokens` back into text."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from radixserve.server.errors import ApiError
from radixserve.server.json_values import json_object
from radixserve.server.limits import check_token_ids
from radixserve.server.openai_api import engine_of, tokenize_chat
from radixserve.server.openai_protocol import ChatMessage, Tool

router = APIRouter()
_MESSAGES = TypeAdapter(list[ChatMessage])
_TOOLS = TypeAdapter(list[Tool] | None)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false", param=name)
    return value


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    engine = engine_of(request)
    body = await json_object(request)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise ApiError(400, 'pass either "prompt" (text) or "messages" (a chat)', param="prompt")
    if messages is not None:
        try:
            chat = _MESSAGES.validate_python(messages)
        except ValidationError as error:
            raise ApiError(400, f"messages: {error.errors()[0]['msg']}", param="messages") from None
        try:
            tools = _TOOLS.validate_python(body.get("tools"))
        except ValidationError as error:
            raise ApiError(400, f"tools: {error.errors()[0]['msg']}", param="tools") from None
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        generation, final = (
            _flag(body, "add_generation_prompt", True),
            _flag(body, "continue_final_message", False),
        )
        rendered = [m.template_dict(engine.image_token) for m in chat]
        tool_dicts = None if tools is None else [t.model_dump(exclude_none=True) for t in tools]
        ids = tokenize_chat(engine, rendered, kwargs, generation, final, tool_dicts)
        if _flag(body, "add_special_tokens", False):
            ids = engine.tokenizer.build_inputs_with_special_tokens(ids)
    else:
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
        special = _flag(body, "add_special_tokens", True)
        ids = await asyncio.to_thread(engine.tokenizer.encode, prompt, add_special_tokens=special)
    strs = engine.tokenizer.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) else None
    return JSONResponse(
        {"count": len(ids), "max_model_len": engine.context_len, "tokens": ids, "token_strs": strs}
    )


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    engine = engine_of(request)
    body = await json_object(request)
    tokens = body.get("tokens")
    check_token_ids(tokens, "tokens")
    assert isinstance(tokens, list)  # check_token_ids refused anything else
    vocab = engine.vocab_size
    if any(token >= vocab for token in tokens):
        raise ApiError(400, f"tokens must be ids below the vocabulary size {vocab}", param="tokens")
    text = await asyncio.to_thread(engine.tokenizer.decode, tokens)
    return JSONResponse({"prompt": text})
