"""The HTTP app: native routes, the OpenAI routes, API-key check, body size cap, error mapping.

The app is a thin layer over an Engine (app.state.engine): it validates and shapes requests and
responses, and never holds scheduling state of its own.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import radixserve
from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.prompts import PromptBatch, split_prompts
from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.runtime.engine import Engine, EngineDeadError, GenerateOutput, QueueFullError
from radixserve.runtime.request_builder import images_per_prompt
from radixserve.server.bootstrap_fields import bootstrap_infos
from radixserve.server.dashboard import add_dashboard, dashboard_authorized
from radixserve.server.embeddings_api import router as embeddings_router
from radixserve.server.errors import ApiError, error_body, error_response
from radixserve.server.json_values import BadJsonValue, ParsedJsonRoute, check_body, json_object
from radixserve.server.limits import check_batch, check_token_ids, parse_sampling_params, per_prompt
from radixserve.server.lora_api import router as lora_router
from radixserve.server.openai_api import SSE_DONE, SSE_MEDIA_TYPE, engine_of, router, sse, stream_error
from radixserve.server.streams import ClientDisconnected, collect, merged_stream
from radixserve.server.tokenize_api import router as tokenize_router

logger = logging.getLogger(__name__)

# /health answers probes without a key; everything else needs it when --api-key is set.
OPEN_PATHS = frozenset({"/health"})
# A generation running this recently proves the scheduler is alive without queueing a probe.
RECENT_OUTPUT_S = 5.0
HEALTH_GENERATE_TIMEOUT_S = 20.0
# Retry-After (seconds) on a 503: a full queue drains within about a second; a stopped engine is
# restarted by a supervisor, if at all, much later.
QUEUE_FULL_RETRY_AFTER_S = 1
ENGINE_DEAD_RETRY_AFTER_S = 30


class GuardMiddleware:
    """API key, request-body cap and JSON values nothing downstream can hold (server/json_values.py),
    before any route runs (pure ASGI, so streams stay streams)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()) and not dashboard_authorized(
                scope["path"], headers, scope.get("query_string", b""), self.api_key
            ):
                response = error_response(
                    401, "Invalid or missing API key (send 'Authorization: Bearer KEY')"
                )
                await response(scope, receive, send)
                return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large()(scope, receive, send)
            return
        # Read the whole body here, under the cap (every route parses JSON anyway), then replay it.
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._too_large()(scope, receive, send)
                return
            more = message.get("more_body", False)
        try:
            check_body(bytes(body), scope)
        except BadJsonValue as bad:
            await error_response(400, str(bad), param=bad.path or None)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay, watched_send)
        except Exception as exc:
            # A bug, not the client's fault: logged with its traceback, answered without it, and the
            # keep-alive connection stays up.
            logger.exception("%s %s failed", scope.get("method"), scope["path"])
            if started:
                raise
            problem = f"internal error ({type(exc).__name__}); see the server log"
            await error_response(500, problem)(scope, receive, send)

    def _too_large(self) -> JSONResponse:
        limit_mb = self.max_body_bytes / 2**20
        return error_response(413, f"request body larger than {limit_mb:g} MiB (--max-request-body-mb)")


class GenerateBody(BaseModel):
    """POST /generate, SGLang's native shape."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    token_ids_logprob: list[int] | list[list[int]] | None = None
    # Continue from an earlier request of a session: {"id", "rid"?, "offset"?, "replace"?}.
    session_params: dict[str, Any] | None = None
    # The prompt as vectors ([length][hidden_size], or a list of those) instead of text or ids.
    input_embeds: list[list[float]] | list[list[list[float]]] | None = None
    return_hidden_states: bool = False
    # "module.path:ClassName" (needs --enable-custom-logit-processor); see docs/server.md.
    custom_logit_processor: str | None = None
    # --enable-lora: the LoRA adapter's name (SGLang's field), or one per prompt (None: the base).
    lora_path: str | list[str | None] | None = None
    # --enable-priority-scheduling: the request's priority (SGLang's field), or one per prompt.
    priority: int | list[int | None] | None = None
    # Vision-language models: an image (data: URL, base64, allowed path or URL) or a list of them
    # for one prompt; for a batch, one such entry (or null) per prompt. Each fills an image token.
    image_data: str | list[str | list[str] | None] | None = None
    # Under --disaggregation-mode: where the request's other half runs (server/bootstrap_fields.py).
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    # Fields sglang-router adds to every /generate it forwards. One model is served here, so
    # `model` is not checked; log_metrics and no_logs change nothing; the three features below are
    # not built, so asking for them is a 422 (their defaults, which the router sends, are fine).
    model: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False

    @field_validator("background", "return_bytes", "return_entropy")
    @classmethod
    def _not_built(cls, value: bool, info: ValidationInfo) -> bool:
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    def prompts(self, engine: Engine) -> PromptBatch:
        for name in ("text", "input_ids", "input_embeds"):
            value = getattr(self, name)
            if isinstance(value, list) and not value:
                raise ApiError(400, f"{name} must not be empty", param=name)
        if isinstance(self.text, list):
            check_batch(len(self.text), "text")
        ids = self.input_ids
        if isinstance(ids, list) and all(isinstance(x, list) for x in ids):
            check_batch(len(ids), "input_ids")
            for index, row in enumerate(ids):
                check_token_ids(row, f"input_ids[{index}]")
        elif ids is not None:
            check_token_ids(ids, "input_ids")
        embeds = self.input_embeds
        if (
            isinstance(embeds, list)
            and isinstance(embeds[0], list)
            and embeds[0]
            and isinstance(embeds[0][0], list)
        ):
            check_batch(len(embeds), "input_embeds")
        return split_prompts(self.text, self.input_ids, self.input_embeds, engine.tokenize, "text")


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="radixserve", version=radixserve.__version__)
    app.router.route_class = ParsedJsonRoute  # the body as the edge parsed it (json_values.py)
    app.state.engine = engine
    app.state.started = time.time()
    app.add_middleware(
        GuardMiddleware,
        api_key=engine.args.api_key,
        max_body_bytes=int(engine.args.max_request_body_mb * 2**20),
    )
    if engine.args.allow_origins:
        # Added last, so it runs first: a preflight OPTIONS carries no API key and no body.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(engine.args.allow_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    _add_error_handlers(app)
    app.include_router(router)
    app.include_router(embeddings_router)
    app.include_router(lora_router)
    app.include_router(tokenize_router)
    add_dashboard(app, engine)
    _add_native_routes(app)
    return app


def unavailable(message: str, retry_after_s: int) -> JSONResponse:
    """A 503 with Retry-After, so that clients (the official SDKs among them) back off and retry."""
    response = error_response(503, message)
    response.headers["Retry-After"] = str(retry_after_s)
    return response


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(QueueFullError)
    async def queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        return unavailable(str(exc), QUEUE_FULL_RETRY_AFTER_S)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return unavailable(f"the engine is not running: {exc}", ENGINE_DEAD_RETRY_AFTER_S)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is listening; nginx's code for the log

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {err.get('msg', 'invalid')}")
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return JSONResponse(error_body(422, "; ".join(problems), param), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


def _add_native_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        engine = engine_of(request)
        if engine.error is not None:
            return unavailable(engine.error, ENGINE_DEAD_RETRY_AFTER_S)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        engine = engine_of(request)
        if engine.error is not None:
            return unavailable(engine.error, ENGINE_DEAD_RETRY_AFTER_S)
        # While requests run, recent outputs prove the scheduler steps: a probe would only queue
        # behind them (possibly a long prefill) and time out for no fault of the server.
        if engine.num_in_flight > 0 and time.monotonic() - engine.last_output_time < RECENT_OUTPUT_S:
            return Response(status_code=200)
        # One token (or, on an embedding model, one embedding) through the whole path.
        req = engine.requests.build([0], {"max_new_tokens": 1, "temperature": 0.0}, embed=engine.is_embedding)
        try:
            await asyncio.wait_for(_last(engine.stream(req)), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            message = f"no token generated within {HEALTH_GENERATE_TIMEOUT_S:g}s"
            return unavailable(message, QUEUE_FULL_RETRY_AFTER_S)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        engine = engine_of(request)
        if engine.metrics is None:
            return error_response(404, "metrics are off; start the server with --enable-metrics")
        stats = await asyncio.to_thread(engine.get_stats)
        return Response(engine.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_load")
    async def get_load(request: Request) -> JSONResponse:
        """One entry per data-parallel rank, as SGLang answers (sglang-router reads this list)."""
        stats = await asyncio.to_thread(engine_of(request).get_stats)
        replicas = stats.get("dp_replicas") or [stats]
        return JSONResponse(
            [
                {
                    "dp_rank": rank,
                    "num_reqs": replica["num_running_reqs"]
                    + replica["num_waiting_reqs"]
                    + replica["num_grammar_queue_reqs"],
                    "num_waiting_reqs": replica["num_waiting_reqs"],
                    "num_tokens": replica["load_tokens"],
                }
                for rank, replica in enumerate(replicas)
            ]
        )

    @app.get("/get_internal_state")
    async def get_internal_state(request: Request) -> JSONResponse:
        result = await asyncio.to_thread(engine_of(request).control, "get_internal_state")
        return JSONResponse(result.payload)

    @app.post("/set_internal_state")
    async def set_internal_state(request: Request) -> JSONResponse:
        body = await json_object(request)
        # SGLang nests the knobs under "server_args"; a flat object works too.
        updates = body.get("server_args", body)
        if not isinstance(updates, dict):
            raise ApiError(400, "server_args must be an object")
        return await _control_json(request, "set_internal_state", updates)

    @app.post("/slow_down")
    async def slow_down(request: Request) -> JSONResponse:
        """A test hook: every forward step sleeps forward_sleep_time seconds (null: no more)."""
        body = await json_object(request)
        delay = body.get("forward_sleep_time")
        if delay is not None and (not isinstance(delay, (int, float)) or delay < 0):
            raise ApiError(400, "forward_sleep_time must be a non-negative number or null")
        result = await asyncio.to_thread(
            engine_of(request).control, "slow_down", 60.0, {"forward_sleep_time": delay}
        )
        return JSONResponse(result.payload)

    @app.post("/start_profile")
    async def start_profile(request: Request) -> JSONResponse:
        """{"output_dir": ..., "num_steps": N, "profile_by_stage": bool}: record forward steps with
        the torch profiler (by stage: one trace for prefill, one for decode)."""
        body = await json_object(request) if await request.body() else {}
        keys = ("output_dir", "num_steps", "profile_by_stage")
        args = {k: body[k] for k in keys if body.get(k) is not None}
        return await _control_json(request, "start_profile", args)

    @app.post("/stop_profile")
    async def stop_profile(request: Request) -> JSONResponse:
        return await _control_json(request, "stop_profile", {})

    # SGLang's routes for a Mixture-of-Experts model: count the tokens each layer routes to each
    # expert from the start to the stop; the dump answers with the counts (SGLang writes a file).
    @app.post("/start_expert_distribution_record")
    async def start_expert_distribution_record(request: Request) -> JSONResponse:
        return await _control_json(request, "start_expert_distribution_record", {})

    @app.post("/stop_expert_distribution_record")
    async def stop_expert_distribution_record(request: Request) -> JSONResponse:
        return await _control_json(request, "stop_expert_distribution_record", {})

    @app.post("/dump_expert_distribution_record")
    async def dump_expert_distribution_record(request: Request) -> JSONResponse:
        return await _control_json(request, "dump_expert_distribution_record", {})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        """{"model_path": ...}: same architecture and shapes. Requests in flight are aborted."""
        body = await json_object(request)
        if not isinstance(body.get("model_path"), str):
            raise ApiError(400, 'pass {"model_path": "..."}', param="model_path")
        return await _control_json(request, "update_weights_from_disk", {"model_path": body["model_path"]})

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> JSONResponse:
        body = await json_object(request) if await request.body() else {}
        return await _control_json(request, "release_memory_occupation", body)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> JSONResponse:
        body = await json_object(request) if await request.body() else {}
        return await _control_json(request, "resume_memory_occupation", body)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> JSONResponse:
        body = await json_object(request)
        if not isinstance(body.get("name"), str):
            raise ApiError(400, 'pass {"name": "...", "truncate_size": N}', param="name")
        truncate = body.get("truncate_size", 100)
        if not isinstance(truncate, int) or isinstance(truncate, bool) or truncate < 0:
            raise ApiError(400, "truncate_size must be a non-negative integer", param="truncate_size")
        args = {"name": body["name"], "truncate_size": truncate}
        return await _control_json(request, "get_weights_by_name", args)

    @app.post("/open_session")
    async def open_session(request: Request) -> JSONResponse:
        body = await json_object(request) if await request.body() else {}
        session_id = body.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            raise ApiError(400, "session_id must be a string", param="session_id")
        return JSONResponse(engine_of(request).open_session(session_id))

    @app.post("/close_session")
    async def close_session(request: Request) -> Response:
        body = await json_object(request)
        if not isinstance(body.get("session_id"), str):
            raise ApiError(400, 'pass {"session_id": "..."}', param="session_id")
        engine_of(request).close_session(body["session_id"])
        return Response(status_code=200)

    @app.post("/configure_logging")
    async def configure_logging(request: Request) -> JSONResponse:
        body = await json_object(request)
        if not isinstance(body.get("log_requests"), bool):
            raise ApiError(400, 'pass {"log_requests": true or false}')
        engine_of(request).log_requests = body["log_requests"]
        return JSONResponse({"log_requests": body["log_requests"]})

    @app.get("/model_info")  # the name sglang-router asks first
    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> JSONResponse:
        engine = engine_of(request)
        return JSONResponse(
            {
                "model_path": engine.args.model_path,
                "tokenizer_path": engine.args.tokenizer_path or engine.args.model_path,
                "served_model_name": engine.served_model_name,
                "is_generation": not engine.is_embedding,
                "context_length": engine.context_len,
                "vocab_size": engine.vocab_size,
            }
        )

    @app.get("/server_info")  # the name sglang-router asks first
    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> JSONResponse:
        engine = engine_of(request)
        stats = await asyncio.to_thread(engine.get_stats)
        args = {**engine.args.to_dict(), "api_key": None}
        return JSONResponse({**args, **stats, "version": radixserve.__version__})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        engine = engine_of(request)
        if not await asyncio.to_thread(engine.flush_cache):
            return error_response(400, "cannot flush the cache while requests are running; retry when idle")
        return Response("Cache flushed.\n", status_code=200)

    @app.api_route("/clear_hicache_storage_backend", methods=["GET", "POST"])
    async def clear_hicache_storage_backend(request: Request) -> Response:
        await asyncio.to_thread(engine_of(request).clear_hicache_storage_backend)
        return Response("Hierarchical cache storage backend cleared.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_object(request)
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not abort_all and not isinstance(rid, str):
            raise ApiError(400, 'pass {"rid": "..."} or {"abort_all": true}')
        engine_of(request).abort(rid=rid if isinstance(rid, str) else None, abort_all=bool(abort_all))
        return Response(status_code=200)

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateBody, request: Request) -> Response:
        engine = engine_of(request)
        batch = body.prompts(engine)
        single = batch.single
        reqs = _native_requests(engine, batch, body)
        texts = engine.tokenizer if body.return_text_in_logprobs else None
        if body.stream:
            return StreamingResponse(
                _stream_native(merged_stream(engine, reqs), single, texts), media_type=SSE_MEDIA_TYPE
            )
        states = await collect(engine, reqs, request)
        results = [_native_result(s, texts) for s in states]
        return JSONResponse(results[0] if single else results)


def _native_requests(engine: Engine, batch: PromptBatch, body: GenerateBody) -> list[GenerateRequest]:
    prompts = batch.ids
    count = len(prompts)
    params = per_prompt(body.sampling_params or {}, count, "sampling_params")
    per_prompt_params = isinstance(body.sampling_params, list)
    params = [
        parse_sampling_params(sp, f"sampling_params[{i}]" if per_prompt_params else "sampling_params")
        for i, sp in enumerate(params)
    ]
    rid = body.rid
    rids: list[str | None]
    if isinstance(rid, list) or count == 1:
        rids = per_prompt(rid, count, "rid")
    else:
        rids = [f"{rid}-{i}" if rid else None for i in range(count)]
    logprobs = per_prompt(body.return_logprob, count, "return_logprob")
    tops = per_prompt(body.top_logprobs_num, count, "top_logprobs_num")
    starts = per_prompt(body.logprob_start_len, count, "logprob_start_len")
    named = body.token_ids_logprob
    per_prompt_ids = isinstance(named, list) and bool(named) and isinstance(named[0], list)
    id_lists = per_prompt(named, count, "token_ids_logprob") if per_prompt_ids else [named] * count
    if body.session_params is not None and count != 1:
        raise ApiError(400, "session_params takes a single prompt", param="session_params")
    bootstraps = bootstrap_infos(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, count)
    adapters = per_prompt(body.lora_path, count, "lora_path")
    images = images_per_prompt(body.image_data, batch.single, count)
    reqs = [
        engine.requests.build(
            p,
            sp,
            r,
            lp,
            top,
            start,
            ids,
            body.session_params,
            input_embeds=vectors,
            return_hidden_states=body.return_hidden_states,
            custom_logit_processor=body.custom_logit_processor,
            lora_path=adapter,
            image_data=image_list,
        )
        for p, sp, r, lp, top, start, ids, vectors, adapter, image_list in zip(
            prompts,
            params,
            rids,
            logprobs,
            tops,
            starts,
            id_lists,
            batch.embeds,
            adapters,
            images,
            strict=True,
        )
    ]
    priorities = per_prompt(body.priority, count, "priority")
    for req, info, priority in zip(reqs, bootstraps, priorities, strict=True):
        req.bootstrap, req.priority = info, priority
    return reqs


def _native_result(state: GenerateOutput, tokenizer: Any | None) -> dict[str, Any]:
    """The native result; with a tokenizer, logprob triples carry each token's text."""
    result = state.to_dict()
    meta = result["meta_info"]
    if tokenizer is not None:
        for kind in ("input", "output"):
            triples = list(meta.get(f"{kind}_token_logprobs", []))
            for position in meta.get(f"{kind}_top_logprobs", []) + meta.get(f"{kind}_token_ids_logprobs", []):
                triples += position or []
            for triple in triples:
                triple[2] = tokenizer.decode([triple[1]])
    return result


async def _stream_native(
    stream: AsyncIterator[tuple[int, GenerateOutput]], single: bool, tokenizer: Any | None
) -> AsyncIterator[str]:
    try:
        async for index, state in stream:
            payload = _native_result(state, tokenizer)
            if not single:
                payload["index"] = index
            yield sse(payload)
    except Exception as exc:
        yield stream_error(exc)
    yield SSE_DONE


async def _last(stream: AsyncIterator[GenerateOutput]) -> GenerateOutput | None:
    last = None
    async for state in stream:
        last = state
    return last


async def _control_json(request: Request, command: str, args: dict[str, Any]) -> JSONResponse:
    """Runs a control command; its refusal is a 400 with the scheduler's message."""
    result = await asyncio.to_thread(engine_of(request).control, command, 60.0, args)
    if not result.ok:
        raise ApiError(400, result.error or f"{command} failed")
    return JSONResponse(result.payload)
