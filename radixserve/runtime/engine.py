"""Engine: the request side of radixserve, used directly (offline Python API) or behind HTTP.

It plays the TokenizerManager's part: it tokenizes and validates requests, sends them to the
scheduler process, and routes the detokenizer's text outputs back to whoever waits for them. A
reader thread receives outputs and hands each to its request's callback, so callers may wait from
any thread (generate) or from any asyncio loop (stream, async_stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from radixserve.config.log import configure_logging
from radixserve.config.lora_args import lora_refs
from radixserve.config.server_args import ServerArgs
from radixserve.models.source import (
    ModelSource,
    load_model_config,
    release_gguf_readers,
    resolve_model_source,
    short_model_id,
)
from radixserve.models.tokenizer import load_tokenizer, set_chat_template
from radixserve.protocol.messages import (
    AbortRequest,
    ControlRequest,
    ControlResult,
    GenerateRequest,
    SchedulerFailed,
    SchedulerInput,
    TextBatch,
    TextOutput,
)
from radixserve.protocol.prompts import (
    InputEmbeds,
    InputIds,
    Prompt,
    PromptLimits,
)
from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.runtime.deadlines import RequestDeadlines
from radixserve.runtime.dp_router import Router, merge_replica_payloads
from radixserve.runtime.engine_control import EngineControl
from radixserve.runtime.generate_output import GenerateOutput
from radixserve.runtime.images import ImageLimits, ImagePreprocessor
from radixserve.runtime.launch import POLL_MS, EngineDeadError, Runtime
from radixserve.runtime.live_stats import LiveStats
from radixserve.runtime.metrics import EngineMetrics
from radixserve.runtime.request_builder import RequestBuilder, SamplingArg
from radixserve.runtime.sessions import SessionStore
from radixserve.runtime.trace_recorder import TraceRecorder

logger = logging.getLogger("radixserve")

__all__ = ["Engine", "EngineDeadError", "GenerateOutput", "QueueFullError"]


# Where one request's outputs go: a thread-safe callback set by the waiting caller. It receives a
# ControlResult instead when the engine dies.
Deliver = Callable[[TextOutput | ControlResult], None]


class QueueFullError(RuntimeError):
    """More requests wait for their first token than --max-queued-requests allows."""


class Engine(EngineControl):
    def __init__(
        self,
        model_path: str | None = None,
        *,
        on_fatal: Callable[[str], None] | None = None,
        **server_args: Any,
    ):
        """`on_fatal` is called (from the reader thread) when a child process dies."""
        self.args = ServerArgs(model_path=model_path, **server_args)
        configure_logging(self.args.log_level)
        self.source: ModelSource = resolve_model_source(self.args.model_path)
        # The children load exactly what was resolved here (no second hub lookup).
        self.args.model_path = str(self.source.path)
        tokenizer_source = (
            resolve_model_source(self.args.tokenizer_path) if self.args.tokenizer_path else self.source
        )
        # --record-trace: every finished request as a line simulate can replay. Opened before any
        # child starts, so that a bad path fails fast.
        self.trace = TraceRecorder(self.args.record_trace) if self.args.record_trace else None
        # The schedulers start first: they load the model while this process loads the tokenizer.
        self.runtime = Runtime(self.args)
        try:
            self.tokenizer = load_tokenizer(tokenizer_source)
            release_gguf_readers()  # this process reads nothing more of a GGUF
            if self.args.chat_template is not None:
                set_chat_template(self.tokenizer, self.args.chat_template)
            self.runtime.provide_tokenizer(self.tokenizer)
        except BaseException:
            self._abandon_start()
            raise
        # /v1/models and responses name the model by this; requests may also name its path.
        self.served_model_name = self.args.served_model_name or short_model_id(model_path, self.source)
        self.lora_adapters = {r.name: r.path for r in lora_refs(self.args.lora_paths, InvalidRequestError)}
        self._on_fatal = on_fatal
        self._pending: dict[str, Deliver] = {}
        # Requests that have not produced output yet: what --max-queued-requests bounds.
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._error: str | None = None
        self._closing = False
        self._ids = itertools.count()
        self.last_output_time = time.monotonic()
        self.metrics = EngineMetrics(self.served_model_name) if self.args.enable_metrics else None
        # --enable-dashboard: request timings for /dashboard (runtime/live_stats.py).
        self.live = LiveStats() if self.args.enable_dashboard else None
        # /configure_logging: log every request's arrival and end.
        self.log_requests = False
        self.sessions = SessionStore()
        self.deadlines = RequestDeadlines(self.args.request_timeout)

        self.router = Router(self.args.dp_size, self.args.load_balance_method)
        try:
            ready = self.runtime.wait_ready()
        except BaseException:
            self._abandon_start()
            raise
        self.max_total_tokens = ready.max_total_tokens
        self.context_len = ready.context_len
        self.vocab_size = ready.vocab_size
        self.is_embedding = ready.is_embedding
        self.hidden_size = ready.hidden_size
        self.requests = RequestBuilder(
            self.vocab_size,
            self.hidden_size,
            self.is_embedding,
            self.args.enable_custom_logit_processor,
            PromptLimits(self.context_len, self.max_total_tokens, self.args.allow_auto_truncate),
            self.sessions,
            self.tokenize,
            self.lora_adapters if self.args.enable_lora else None,
            images=self._image_preprocessor(),
        )
        logger.info(
            "scheduler ready: KV cache holds %d tokens, context length %d",
            ready.max_total_tokens,
            ready.context_len,
        )
        if self.trace is not None:
            self.trace.start()  # arrivals count from here, when requests can be served
        self._reader = threading.Thread(target=self._read_outputs, name="radixserve-outputs", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ outputs in

    def _read_outputs(self) -> None:
        next_check = 0.0
        # Under --sleep-on-idle a dead child is noticed within a second instead of 0.2 s.
        poll_ms = 1000 if self.args.sleep_on_idle else POLL_MS
        while not self._closing:
            msg = self.runtime.recv(poll_ms)
            if isinstance(msg, TextBatch):
                self.last_output_time = time.monotonic()
                self._dispatch(msg.outputs)
            elif isinstance(msg, ControlResult):
                self._dispatch([msg])
            elif isinstance(msg, SchedulerFailed):
                # A rank that failed because a peer was killed: name the kill first.
                dead = self.runtime.dead_child()
                cause = f"{dead}; " if dead is not None and "killed by" in dead else ""
                self._fail(f"{cause}the scheduler stopped with an error:\n{msg.error}")
                return
            if self.deadlines:
                self._abort_late_requests()
            # Checked between messages too, so that a busy stream cannot hide a dead child.
            if time.monotonic() >= next_check and not self._closing:
                next_check = time.monotonic() + poll_ms / 1000
                if (dead := self.runtime.dead_child()) is not None:
                    self._fail(dead)
                    return

    def _abort_late_requests(self) -> None:
        timeout = self.args.request_timeout
        for rid in self.deadlines.expired(time.monotonic()):
            logger.warning("request %s did not finish within --request-timeout %g s: aborted", rid, timeout)
            message = f"the request did not finish within {timeout:g} s (--request-timeout)"
            self.abort(rid, exact=True, message=message, status_code=503)

    def _fail(self, error: str) -> None:
        logger.error("%s", error)
        with self._lock:
            self._error = error
            pending = list(self._pending.values())
            self._pending.clear()
            self._queued.clear()
        for deliver in pending:
            with contextlib.suppress(Exception):  # a receiver that is gone cannot be told
                deliver(ControlResult("", False, error=f"engine died: {error}"))
        if self._on_fatal is not None:
            self._on_fatal(error)

    def _dispatch(self, outputs: list[TextOutput] | list[ControlResult]) -> None:
        for out in outputs:
            if self.log_requests and isinstance(out, TextOutput) and out.finished_reason is not None:
                logger.info(
                    "request %s finished: %s, %d prompt + %d completion tokens (%d cached)",
                    out.rid,
                    out.finished_reason.to_dict(),
                    out.prompt_tokens,
                    out.completion_tokens,
                    out.cached_tokens,
                )
            if self.metrics is not None and isinstance(out, TextOutput):
                finish = out.finished_reason
                usage = (out.prompt_tokens, out.completion_tokens, out.cached_tokens)
                aborted = finish is not None and finish.type == "abort"
                self.metrics.output(out.rid, len(out.new_token_ids), finish is not None, usage, aborted)
            if self.live is not None and isinstance(out, TextOutput):
                finish_type = None if out.finished_reason is None else out.finished_reason.type
                self.live.output(out.rid, len(out.new_token_ids), out.cached_tokens, finish_type)
            if self.trace is not None and isinstance(out, TextOutput) and out.received_at is not None:
                self.trace.received(out.rid, out.received_at, out.received_idle, out.first_output_at)
            if isinstance(out, TextOutput) and out.finished_reason is not None:
                self.router.done(out.rid)
                self.deadlines.done(out.rid)
                if self.trace is not None:
                    self.trace.finished(out.rid, out.completion_tokens, out.finished_reason)
            with self._lock:
                self._queued.discard(out.rid)
                deliver = self._pending.get(out.rid)
                if deliver is not None and (
                    isinstance(out, ControlResult) or out.finished_reason is not None
                ):
                    del self._pending[out.rid]
            if deliver is not None:
                try:
                    deliver(out)
                except Exception:
                    # A caller that went away (closed event loop) must not take the reader down.
                    logger.warning("dropped an output for %s: its receiver is gone", out.rid)

    # ------------------------------------------------------------------ requests out

    def _send(self, msg: SchedulerInput, replica: int = 0) -> None:
        with self._send_lock:
            if isinstance(msg, AbortRequest):
                # Every replica hears it: simpler than tracking where a rid went (unknown ones are ignored).
                self.runtime.broadcast(msg)
            else:
                self.runtime.send(msg, replica)

    def submit(self, msg: GenerateRequest | ControlRequest, deliver: Deliver, replica: int = 0) -> None:
        """Sends msg and has its outputs delivered. A generation request goes to the replica the
        router picks (--dp-size); a control request to the one named."""
        # Checked under the lock _fail takes, so a request is either refused here or failed there.
        with self._lock:
            if self._error is not None or self._closing:
                raise EngineDeadError(f"the engine is not running: {self._error or 'shut down'}")
            if msg.rid in self._pending:
                raise InvalidRequestError(f"request id {msg.rid!r} is already in use")
            if isinstance(msg, GenerateRequest):
                bound = self.args.max_queued_requests
                if bound is not None and len(self._queued) >= bound:
                    waiting = len(self._queued)
                    raise QueueFullError(
                        f"{waiting} requests are waiting (--max-queued-requests {bound}); retry later"
                    )
                self._queued.add(msg.rid)
                if self.log_requests:
                    logger.info(
                        "request %s: %d prompt tokens, %s", msg.rid, len(msg.input_ids), msg.sampling_params
                    )
                if self.metrics is not None:
                    self.metrics.submitted(msg.rid)
                if self.live is not None:
                    self.live.submitted(msg.rid, len(msg.input_ids))
                self.deadlines.start(msg.rid, time.monotonic())
                if self.trace is not None:
                    prompt_len = len(msg.input_embeds) if msg.input_embeds else len(msg.input_ids)
                    self.trace.submitted(msg.rid, msg.input_ids, prompt_len)
            self._pending[msg.rid] = deliver
            if isinstance(msg, GenerateRequest):
                replica = self.router.pick(msg)
        try:
            self._send(msg, replica)
        except EngineDeadError:
            self._forget(msg.rid)
            raise

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._pending.pop(rid, None)
            self._queued.discard(rid)
        self.router.done(rid)
        self.deadlines.done(rid)
        if self.trace is not None:
            self.trace.forget(rid)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ building requests

    def _image_preprocessor(self) -> ImagePreprocessor | None:
        """A vision-language model's image processor and limits (None for a text-only model)."""
        if self.source.kind != "hf_dir":
            return None
        vision = load_model_config(self.source).vision
        if vision is None:
            return None
        args = self.args
        root = args.allowed_local_media_path
        limits = ImageLimits(
            args.max_images_per_request,
            args.max_image_bytes,
            args.max_image_pixels,
            Path(root).resolve() if root else None,
            args.enable_image_url_fetch,
        )
        return ImagePreprocessor(self.source.path, vision, limits)

    @property
    def image_token(self) -> str | None:
        """The text that stands for one image in a prompt (None: the model takes no images)."""
        images = self.requests.images
        if images is None:
            return None
        token = self.tokenizer.convert_ids_to_tokens(images.vision.image_token_id)
        return str(token)

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text)
        return ids

    def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """The prompt ids of a chat, through the tokenizer's chat template (--chat-template's
        where given)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; use the completions API or start the server with "
                "--chat-template"
            )
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
        # The template already holds any BOS the model wants.
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    # ------------------------------------------------------------------ generation

    def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Submits req now (so refusals such as QueueFullError raise here) and returns an iterator
        over its state after every output. Leaving the iteration early (a break, a cancelled task,
        a client that disconnected) aborts the request. A caller that never iterates must abort
        the request itself."""
        loop = asyncio.get_running_loop()
        box: asyncio.Queue[TextOutput | ControlResult] = asyncio.Queue()

        def deliver(out: TextOutput | ControlResult) -> None:
            loop.call_soon_threadsafe(box.put_nowait, out)

        started = time.perf_counter()
        self.submit(req, deliver)
        return self._follow(req, box, started)

    @staticmethod
    def _new_state(req: GenerateRequest) -> GenerateOutput:
        return GenerateOutput(
            req.rid,
            prompt_ids=req.input_ids,
            logprob_start_len=req.logprob_start_len,
            token_ids_logprob=req.token_ids_logprob,
        )

    async def _follow(
        self, req: GenerateRequest, box: asyncio.Queue[TextOutput | ControlResult], started: float
    ) -> AsyncIterator[GenerateOutput]:
        rid = req.rid
        state = self._new_state(req)
        try:
            while not state.finished:
                out = await box.get()
                if isinstance(out, ControlResult):
                    raise EngineDeadError(out.error or "engine stopped")
                state.update(out, started)
                if state.finished:
                    self._remember_session_turn(req, state)
                yield state
        finally:
            if not state.finished and self._error is None:
                self._forget(rid)
                with contextlib.suppress(EngineDeadError):
                    self.abort(rid)

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: SamplingArg = None,
        input_ids: InputIds = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        token_ids_logprob: list[int] | None = None,
        input_embeds: InputEmbeds = None,
        return_hidden_states: bool = False,
        custom_logit_processor: str | None = None,
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
        priority: int | list[int | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Blocking generation. One prompt gives one result dict; a list gives a list, in order.
        With return_logprob, meta_info holds output_token_logprobs and output_top_logprobs, and
        with logprob_start_len >= 0 also input_token_logprobs and input_top_logprobs; with
        token_ids_logprob, the logprobs of those ids at every position (*_token_ids_logprobs).
        input_embeds gives the prompt as vectors ([length][hidden_size]) instead of text or ids;
        return_hidden_states puts the final hidden state behind each output token in
        meta_info["hidden_states"]. custom_logit_processor names a processor class the server can
        import ("module:Class"; needs enable_custom_logit_processor), with its arguments in
        sampling_params["custom_params"]. lora_path names the LoRA adapter to run with (one name,
        or one per prompt; None: the base model). image_data gives a vision-language model's
        images (data: URLs, base64, allowed paths or URLs; see runtime/images.py): for one prompt
        one image or a list, for a batch one entry per prompt; each image fills one image token of
        its prompt. priority (one, or one per prompt) orders admission under
        enable_priority_scheduling."""
        reqs, single = self.requests.build_batch(
            prompt,
            input_ids,
            sampling_params,
            return_logprob,
            top_logprobs_num,
            logprob_start_len,
            token_ids_logprob,
            input_embeds=input_embeds,
            return_hidden_states=return_hidden_states,
            custom_logit_processor=custom_logit_processor,
            lora_path=lora_path,
            image_data=image_data,
            priority=priority,
        )
        return self._run_blocking(reqs, single)

    def encode(
        self, prompt: Prompt = None, input_ids: InputIds = None
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Embeddings, on an embedding model. One text gives {"embedding": [...], "meta_info": ...};
        a list gives a list, in order. The texts are batched like any other requests."""
        reqs, single = self.requests.build_batch(prompt, input_ids, None, embed=True)
        return self._run_blocking(reqs, single)

    def _run_blocking(
        self, reqs: list[GenerateRequest], single: bool
    ) -> dict[str, Any] | list[dict[str, Any]]:
        inboxes: list[queue.Queue[TextOutput | ControlResult]] = []
        started = time.perf_counter()
        for req in reqs:
            req.stream = False  # nothing reads its output before it finishes
            box: queue.Queue[TextOutput | ControlResult] = queue.Queue()
            inboxes.append(box)
            self.submit(req, box.put)
        results = []
        for req, box in zip(reqs, inboxes, strict=True):
            state = self._new_state(req)
            while not state.finished:
                out = box.get()
                if isinstance(out, ControlResult):
                    raise EngineDeadError(out.error or "engine stopped")
                state.update(out, started)
            self._remember_session_turn(req, state)
            results.append(state.to_dict())
        return results[0] if single else results

    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        result: dict[str, Any] = {}
        async for chunk in self.async_stream(prompt, sampling_params, input_ids):
            result = chunk
        return result

    async def async_stream(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yields the result so far after every output, with the new text under "delta"."""
        reqs, _ = self.requests.build_batch(prompt, input_ids, sampling_params)
        async for state in self.stream(reqs[0]):
            yield {**state.to_dict(), "delta": state.delta}

    # ------------------------------------------------------------------ control

    def open_session(self, session_id: str | None = None) -> str:
        """Opens a session (see sessions.py); returns its id. Reopening an open id fails."""
        return self.sessions.open(session_id)

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id)
        self.router.forget_session(session_id)

    def _remember_session_turn(self, req: GenerateRequest, state: GenerateOutput) -> None:
        finish = state.finish_reason
        if req.session_id is not None and finish is not None and finish.type != "abort":
            self.sessions.record(
                req.session_id, req.rid, req.session_parent, req.input_ids + state.output_ids
            )

    def abort(
        self,
        rid: str | None = None,
        abort_all: bool = False,
        *,
        exact: bool = False,
        message: str = "aborted by request",
        status_code: int | None = None,
    ) -> None:
        """Ends the requests whose rid starts with rid (only rid itself when exact), or all of them,
        with finish reason "abort" and this message; a status_code makes the answer that HTTP error."""
        self._send(AbortRequest(rid, abort_all, exact, message, status_code))

    def control(
        self, command: str, timeout: float = 60.0, args: dict[str, Any] | None = None
    ) -> ControlResult:
        """Runs a control command on every scheduler replica; with several (--dp-size), their
        answers are merged (see runtime/dp_router.py: merge_replica_payloads)."""
        box: queue.Queue[TextOutput | ControlResult] = queue.Queue()
        rid = f"ctl-{next(self._ids)}"
        replicas = range(self.runtime.num_replicas)
        rids = [rid] if len(replicas) == 1 else [f"{rid}@{i}" for i in replicas]
        for replica, replica_rid in zip(replicas, rids, strict=True):
            self.submit(ControlRequest(replica_rid, command, dict(args or {})), box.put, replica)
        results: dict[str, ControlResult] = {}
        deadline = time.monotonic() + timeout
        while len(results) < len(rids):
            try:
                out = box.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                for pending in rids:
                    self._forget(pending)
                raise TimeoutError(f"the scheduler did not answer {command!r} within {timeout}s") from None
            assert isinstance(out, ControlResult)
            if out.rid == "" and not out.ok:
                raise EngineDeadError(out.error or "engine stopped")
            results[out.rid] = out
        if len(rids) == 1:
            return results[rid]
        answers = [results[r] for r in rids]
        failed = [f"dp rank {i}: {a.error}" for i, a in enumerate(answers) if not a.ok]
        if failed:
            return ControlResult(rid, False, error="; ".join(failed))
        return ControlResult(rid, True, payload=merge_replica_payloads([a.payload for a in answers]))

    @property
    def error(self) -> str | None:
        return self._error

    def shutdown(self) -> None:
        if self.runtime.closed:
            return
        self._closing = True
        self._reader.join(timeout=5)
        self.runtime.shutdown()
        if self.trace is not None:
            self.trace.close()

    def _abandon_start(self) -> None:
        """A start that failed: no child left running, no trace file left open."""
        self.runtime.kill()
        if self.trace is not None:
            self.trace.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
