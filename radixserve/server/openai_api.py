"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from radixserve.protocol.messages import FinishReason, GenerateRequest, TokenLogprobs
from radixserve.protocol.sampling_params import InvalidRequestError, choice_params
from radixserve.runtime.engine import Engine, EngineDeadError, GenerateOutput, QueueFullError
from radixserve.server.bootstrap_fields import bootstrap_infos
from radixserve.server.chat_reply import ReplyFormat
from radixserve.server.errors import ApiError, sse_error
from radixserve.server.json_values import ParsedJsonRoute
from radixserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixserve.server.reasoning import ReasoningFormat, reasoning_format
from radixserve.server.streams import collect, merged_stream, shared_prompt_leaders
from radixserve.server.tool_calls import ToolPlan, plan_tools

router = APIRouter(route_class=ParsedJsonRoute)

SSE_DONE = "data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"


def engine_of(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


def check_model(engine: Engine, model: str | None) -> str | None:
    """The LoRA adapter `model` names (as vLLM and SGLang take it), None for the base model; a
    404 for a name this server does not serve."""
    if model is None or model in (engine.served_model_name, engine.args.model_path):
        return None
    if model in engine.lora_adapters:
        return model
    served = ", ".join(f"'{name}'" for name in [engine.served_model_name, *sorted(engine.lora_adapters)])
    raise ApiError(
        404,
        f"The model '{model}' does not exist; this server serves {served}",
        param="model",
        code="model_not_found",
    )


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class Reply:
    """What every response (and every chunk) of one call shares."""

    engine: Engine
    object: str
    prompt_tokens: int
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def payload(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.engine.served_model_name,
            "choices": choices,
            **extra,
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        # With include_usage every chunk has a usage field: null until the last one.
        return sse(self.payload(choices, usage=usage) if self.include_usage else self.payload(choices))

    def usage(self, states: list[GenerateOutput]) -> dict[str, Any]:
        completion = sum(s.completion_tokens for s in states)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in states)},
        }

    def token_text(self, token: int) -> str:
        return str(self.engine.tokenizer.decode([token]))


def finish_fields(finish: FinishReason | None, made_calls: bool = False) -> dict[str, Any]:
    """A choice's finish: a reply that stopped on its own after making tool calls finishes with
    "tool_calls", as OpenAI's do."""
    reason: str | None = None if finish is None else finish.type
    if made_calls and reason == "stop":
        reason = "tool_calls"
    fields: dict[str, Any] = {"finish_reason": reason}
    if finish is not None:
        # SGLang's extra: which stop string or token ended the choice.
        fields["matched_stop"] = finish.matched
    return fields


def stream_error(exc: Exception) -> str:
    if isinstance(exc, ApiError):
        return sse_error(exc.status, exc.message)
    if isinstance(exc, InvalidRequestError):
        return sse_error(400, str(exc))
    if isinstance(exc, (QueueFullError, EngineDeadError)):
        return sse_error(503, str(exc))
    return sse_error(500, f"{type(exc).__name__}: {exc}")


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    engine = engine_of(request)
    created = int(request.app.state.started)
    model = {
        "id": engine.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "radixserve",
        "root": engine.args.model_path,
        "max_model_len": engine.context_len,
    }
    # LoRA adapters are models of their own to OpenAI clients, as vLLM lists them.
    adapters = [
        {**model, "id": name, "root": path, "parent": engine.served_model_name}
        for name, path in sorted(engine.lora_adapters.items())
    ]
    return JSONResponse({"object": "list", "data": [model, *adapters]})


# ---------------------------------------------------------------------- completions


def completion_logprobs(
    reply: Reply,
    ids: list[int],
    logprobs: TokenLogprobs | None,
    offset: int,
    prompt: GenerateOutput | None = None,
) -> dict[str, Any] | None:
    """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset.
    With `prompt` (echo), the prompt's tokens come first; the very first one has no logprob."""
    if logprobs is None:
        return None
    token_ids: list[int] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if prompt is not None and prompt.input_logprobs is not None:
        triples, top_triples = prompt.prompt_logprob_triples()
        token_ids += [t for _, t, _ in triples]
        values += [v for v, _, _ in triples]
        tops += [None if top is None else {reply.token_text(t): v for v, t, _ in top} for top in top_triples]
    token_ids += ids[: len(logprobs.logprobs)]
    values += logprobs.logprobs
    tops += [
        {reply.token_text(t): v for t, v in zip(top_ids, top_values, strict=True)}
        for top_ids, top_values in zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)
    ]
    tokens = [reply.token_text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def attach_request_fields(
    body: CompletionRequest | ChatCompletionRequest, reqs: list[GenerateRequest]
) -> None:
    """The body's per-call fields that are not sampling: the PD bootstrap, the priority."""
    infos = bootstrap_infos(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, len(reqs))
    for req, info in zip(reqs, infos, strict=True):
        req.bootstrap, req.priority = info, body.priority


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    engine = engine_of(request)
    adapter = check_model(engine, body.model)
    body.refuse_unsupported()
    return_logprob, top, start = body.logprob_request()
    params = body.sampling_params(body.max_tokens, default_max_tokens=16)
    prompts = [engine.tokenize(p) if isinstance(p, str) else p for p in body.prompts()]
    # Choice i*n + j is the j-th sample of prompt i, as OpenAI numbers them.
    reqs = [
        engine.requests.build(
            ids, choice_params(params, j), None, return_logprob, top, start, lora_path=adapter
        )
        for ids in prompts
        for j in range(body.n)
    ]
    attach_request_fields(body, reqs)
    echoes = [str(engine.tokenizer.decode(r.input_ids)) if body.echo else "" for r in reqs]
    prompt_tokens = sum(len(reqs[i * body.n].input_ids) for i in range(len(prompts)))
    reply = Reply(engine, "text_completion", prompt_tokens, body.include_usage, id=f"cmpl-{uuid.uuid4().hex}")
    leaders = shared_prompt_leaders(len(prompts), body.n)
    if body.stream:
        stream = merged_stream(engine, reqs, leaders)
        return StreamingResponse(_stream_completions(reply, stream, echoes), media_type=SSE_MEDIA_TYPE)
    states = await collect(engine, reqs, request, leaders)
    choices = [
        {
            "index": i,
            "text": echoes[i] + s.text,
            # With echo, text offsets count from the start of the prompt text.
            "logprobs": completion_logprobs(reply, s.output_ids, s.logprobs, 0, s if body.echo else None),
            **finish_fields(s.finish_reason),
        }
        for i, s in enumerate(states)
    ]
    return JSONResponse(reply.payload(choices, usage=reply.usage(states)))


async def _stream_completions(
    reply: Reply, stream: AsyncIterator[tuple[int, GenerateOutput]], echoes: list[str]
) -> AsyncIterator[str]:
    finals: dict[int, GenerateOutput] = {}
    offsets = [0] * len(echoes)
    echoed = [not e for e in echoes]
    try:
        async for index, state in stream:
            if not state.delta and not state.finished and state.new_logprobs is None:
                continue
            prefix = ""
            if not echoed[index]:
                # The prompt goes out with the first chunk, and its logprobs (if any) with it.
                prefix, echoed[index] = echoes[index], True
            prompt = state if prefix and state.input_logprobs is not None else None
            logprobs = completion_logprobs(
                reply, state.new_token_ids, state.new_logprobs, offsets[index], prompt
            )
            if logprobs is not None:
                offsets[index] += sum(len(t) for t in logprobs["tokens"])
            choice = {"index": index, "text": prefix + state.delta, "logprobs": logprobs}
            yield reply.chunk([{**choice, **finish_fields(state.finish_reason)}])
            if state.finished:
                finals[index] = state
        if reply.include_usage:
            yield reply.chunk([], reply.usage(list(finals.values())))
    except Exception as exc:
        yield stream_error(exc)
    yield SSE_DONE


# ---------------------------------------------------------------------- chat


def chat_logprobs(reply: Reply, ids: list[int], logprobs: TokenLogprobs | None) -> dict[str, Any] | None:
    """OpenAI chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    if logprobs is None:
        return None

    def entry(token: int, value: float) -> dict[str, Any]:
        text = reply.token_text(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = [
        {
            **entry(token, value),
            "top_logprobs": [entry(t, v) for t, v in zip(top_ids, top_values, strict=True)],
        }
        for token, value, top_ids, top_values in zip(
            ids, logprobs.logprobs, logprobs.top_ids, logprobs.top_logprobs, strict=False
        )
    ]
    return {"content": content}


# apply_chat_template's own arguments, which chat_template_kwargs may not override.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
        "chat_template", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
        "truncation", "max_length", "tokenizer_kwargs", "tools",
    }
)  # fmt: skip


def tokenize_chat(
    engine: Engine,
    messages: list[dict[str, Any]],
    kwargs: dict[str, Any],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """A chat's prompt ids; chat_template_kwargs (`kwargs`) may not set apply_chat_template's own
    arguments, and a template that refuses the messages is a 400. tools: passed to the template
    as transformers passes them."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ApiError(
            400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    try:
        if tools is not None:
            kwargs = {**kwargs, "tools": tools}
        return engine.tokenize_chat(messages, add_generation_prompt, continue_final_message, **kwargs)
    except InvalidRequestError:
        raise
    except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        # The template itself refused these messages (e.g. roles that do not alternate).
        raise ApiError(
            400, f"the chat template cannot render these messages: {exc}", param="messages"
        ) from exc


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    engine = engine_of(request)
    adapter = check_model(engine, body.model)
    body.refuse_unsupported()
    return_logprob, top = body.logprob_request()
    messages = [m.template_dict(engine.image_token) for m in body.messages]
    images = [url for m in body.messages for url in m.image_urls()]
    plan = plan_tools(body, engine.args.tool_call_parser)
    kwargs = body.chat_template_kwargs or {}
    prompt = tokenize_chat(engine, messages, kwargs, tools=plan.template_tools())
    # Without max_tokens a chat may use the rest of the context; the scheduler clips to it.
    params = body.sampling_params(
        body.requested_max_tokens, default_max_tokens=engine.context_len, tool_grammar=plan.grammar()
    )
    reply_format = ReplyFormat(_reasoning(engine, kwargs, plan), plan)
    reqs = [
        engine.requests.build(
            prompt,
            choice_params(params, j),
            return_logprob=return_logprob,
            top_logprobs_num=top,
            lora_path=adapter,
            image_data=images,
        )
        for j in range(body.n)
    ]
    attach_request_fields(body, reqs)
    # The prompt as it runs: each image counted as the tokens it takes.
    reply = Reply(
        engine,
        "chat.completion",
        len(reqs[0].input_ids),
        body.include_usage,
        id=f"chatcmpl-{uuid.uuid4().hex}",
    )
    if body.stream:
        reply.object = "chat.completion.chunk"
        stream = merged_stream(engine, reqs, shared_prompt_leaders(1, body.n))
        return StreamingResponse(
            _stream_chat(reply, stream, len(reqs), reply_format), media_type=SSE_MEDIA_TYPE
        )
    states = await collect(engine, reqs, request, shared_prompt_leaders(1, body.n))
    choices = []
    for i, s in enumerate(states):
        message = {"role": "assistant", **reply_format.message_fields(s.text)}
        choice = {"index": i, "message": message, "logprobs": chat_logprobs(reply, s.output_ids, s.logprobs)}
        choices.append({**choice, **finish_fields(s.finish_reason, "tool_calls" in message)})
    return JSONResponse(reply.payload(choices, usage=reply.usage(states)))


def _reasoning(engine: Engine, template_kwargs: dict[str, Any], plan: ToolPlan) -> ReasoningFormat | None:
    """The reasoning format a reply is split by: --reasoning-parser's, unless the request turned
    thinking off (chat_template_kwargs enable_thinking: false) or a grammar makes it a call."""
    parser = engine.args.reasoning_parser
    if parser is None or template_kwargs.get("enable_thinking") is False or plan.constrained:
        return None
    return reasoning_format(parser)


async def _stream_chat(
    reply: Reply,
    stream: AsyncIterator[tuple[int, GenerateOutput]],
    num_choices: int,
    reply_format: ReplyFormat,
) -> AsyncIterator[str]:
    finals: dict[int, GenerateOutput] = {}
    # Each choice's text split as it comes: reasoning, answer and tool-call deltas.
    splits = {index: reply_format.stream() for index in range(num_choices)}
    try:
        # OpenAI's first delta of each choice names the role and carries no text.
        for index in range(num_choices):
            yield reply.chunk(
                [{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            )
        async for index, state in stream:
            logprobs = chat_logprobs(reply, state.new_token_ids, state.new_logprobs)
            split = splits[index]
            part = split.feed(state.delta, state.finished)
            if part.reasoning:
                delta = {"reasoning_content": part.reasoning}
                yield reply.chunk([{"index": index, "delta": delta, "finish_reason": None}])
            if part.content or logprobs is not None:
                choice = {"index": index, "delta": {"content": part.content}, "finish_reason": None}
                yield reply.chunk([{**choice, "logprobs": logprobs}])
            if part.calls:
                calls = {"tool_calls": split.call_chunks(part.calls)}
                yield reply.chunk([{"index": index, "delta": calls, "finish_reason": None}])
            if state.finished:
                finals[index] = state
                finish = finish_fields(state.finish_reason, split.made_calls)
                yield reply.chunk([{"index": index, "delta": {}, **finish}])
        if reply.include_usage:
            yield reply.chunk([], reply.usage(list(finals.values())))
    except Exception as exc:
        yield stream_error(exc)
    yield SSE_DONE
