"""Engine: the offline Python API. The scheduler runs its event loop in a background thread; callers
submit requests from any thread (generate) or from asyncio (async_generate), and results come back
through per-request queues."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.args import ServerArgs
from radixserve.detokenize import IncrementalDetokenizer
from radixserve.messages import (
    AbortRequest,
    ControlRequest,
    ControlResult,
    GenerateRequest,
    ReqOutput,
    SchedulerInput,
    SchedulerOutput,
    ShutdownRequest,
)
from radixserve.model.loader import ModelSource, load_tokenizer, resolve_model_source
from radixserve.model.runner import ModelRunner
from radixserve.sampling_params import InvalidRequestError
from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("radixserve")

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None


class EngineDeadError(RuntimeError):
    """The scheduler thread stopped with an error; the engine cannot serve more requests."""


def configure_logging(level: str) -> None:
    root = logging.getLogger("radixserve")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level.upper())


@dataclass
class _Pending:
    """Where one request's outputs go: a thread-safe callback set by the waiting caller."""

    deliver: Callable[[SchedulerOutput], None]
    started: float = field(default_factory=time.perf_counter)


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any):
        self.args = ServerArgs(model_path=model_path, **server_args)
        configure_logging(self.args.log_level)
        self.source: ModelSource = resolve_model_source(self.args.model_path)
        tokenizer_source = (
            resolve_model_source(self.args.tokenizer_path) if self.args.tokenizer_path else self.source
        )
        self.tokenizer = load_tokenizer(tokenizer_source)
        self.scheduler = Scheduler(self.args, ModelRunner(self.args, self.source))
        self.max_total_tokens = self.scheduler.max_total_tokens
        self._inbox: queue.Queue[SchedulerInput] = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run_scheduler, name="radixserve-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ scheduler thread

    def _run_scheduler(self) -> None:
        try:
            self.scheduler.event_loop(self._inbox, self._dispatch)
        except BaseException as exc:
            logger.exception("scheduler stopped with an error")
            self._error = exc
            with self._lock:
                pending = list(self._pending.values())
                self._pending.clear()
            for p in pending:
                p.deliver(ControlResult("", False, error=f"engine died: {exc!r}"))

    def _dispatch(self, outputs: list[SchedulerOutput]) -> None:
        for out in outputs:
            with self._lock:
                pending = self._pending.get(out.rid)
                if pending is not None and (
                    isinstance(out, ControlResult) or out.finished_reason is not None
                ):
                    del self._pending[out.rid]
            if pending is not None:
                try:
                    pending.deliver(out)
                except Exception:
                    # A caller that went away (closed event loop) must not take the scheduler down.
                    logger.warning("dropped an output for %s: its receiver is gone", out.rid)

    def _submit(self, msg: SchedulerInput, deliver: Callable[[SchedulerOutput], None]) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine is not running: {self._error!r}")
        rid = msg.rid if isinstance(msg, (GenerateRequest, ControlRequest)) else None
        if rid is not None:
            with self._lock:
                self._pending[rid] = _Pending(deliver)
        self._inbox.put(msg)

    # ------------------------------------------------------------------ requests

    def _build_requests(
        self,
        prompt: Prompt,
        input_ids: InputIds,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
    ) -> tuple[list[GenerateRequest], bool]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("pass exactly one of prompt or input_ids")
        batch_ids: list[list[int]]
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            batch_ids = [self.tokenizer.encode(t) for t in texts]
        else:
            assert input_ids is not None
            single = bool(input_ids) and isinstance(input_ids[0], int)
            batch_ids = [list(input_ids)] if single else [list(x) for x in input_ids]  # type: ignore[arg-type]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(batch_ids):
                raise InvalidRequestError("sampling_params list must have one entry per prompt")
            params = sampling_params
        else:
            params = [dict(sampling_params or {}) for _ in batch_ids]
        reqs = [
            GenerateRequest(f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", ids, dict(p))
            for ids, p in zip(batch_ids, params, strict=True)
        ]
        return reqs, single

    def _result(
        self, req: GenerateRequest, output_ids: list[int], last: ReqOutput, started: float
    ) -> dict[str, Any]:
        finish = last.finished_reason
        return {
            "text": self.tokenizer.decode(output_ids, skip_special_tokens=True),
            "output_ids": output_ids,
            "meta_info": {
                "id": req.rid,
                "finish_reason": finish.to_dict() if finish else None,
                "prompt_tokens": last.prompt_tokens,
                "completion_tokens": last.completion_tokens,
                "cached_tokens": last.cached_tokens,
                "e2e_latency": time.perf_counter() - started,
            },
        }

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: InputIds = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Blocking generation. One prompt gives one result dict; a list gives a list, in order."""
        reqs, single = self._build_requests(prompt, input_ids, sampling_params)
        inboxes: list[queue.Queue[SchedulerOutput]] = []
        started = time.perf_counter()
        for req in reqs:
            box: queue.Queue[SchedulerOutput] = queue.Queue()
            inboxes.append(box)
            self._submit(req, box.put)
        results = [self._collect(req, box, started) for req, box in zip(reqs, inboxes, strict=True)]
        return results[0] if single else results

    def _collect(
        self, req: GenerateRequest, box: queue.Queue[SchedulerOutput], started: float
    ) -> dict[str, Any]:
        output_ids: list[int] = []
        while True:
            out = box.get()
            if isinstance(out, ControlResult):
                raise EngineDeadError(out.error or "engine stopped")
            output_ids += out.new_token_ids
            if out.finished_reason is not None:
                return self._result(req, output_ids, out, started)

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
        """Yields a dict per scheduler output: the text delta, the new ids, and the result so far.
        Cancelling the iteration aborts the request."""
        reqs, _ = self._build_requests(prompt, input_ids, sampling_params)
        req = reqs[0]
        loop = asyncio.get_running_loop()
        box: asyncio.Queue[SchedulerOutput] = asyncio.Queue()
        started = time.perf_counter()

        def deliver(out: SchedulerOutput) -> None:
            loop.call_soon_threadsafe(box.put_nowait, out)

        self._submit(req, deliver)
        detok = IncrementalDetokenizer(self.tokenizer)
        output_ids: list[int] = []
        finished = False
        try:
            while not finished:
                out = await box.get()
                if isinstance(out, ControlResult):
                    raise EngineDeadError(out.error or "engine stopped")
                finished = out.finished_reason is not None
                output_ids += out.new_token_ids
                delta = detok.push(out.new_token_ids, final=finished)
                chunk = self._result(req, list(output_ids), out, started)
                chunk["delta"] = delta
                chunk["text"] = detok.text
                yield chunk
        finally:
            if not finished:
                with self._lock:
                    self._pending.pop(req.rid, None)
                self.abort(req.rid)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._inbox.put(AbortRequest(rid=rid, abort_all=abort_all))

    def control(self, command: str, timeout: float = 60.0) -> ControlResult:
        box: queue.Queue[SchedulerOutput] = queue.Queue()
        self._submit(ControlRequest(f"ctl-{next(self._ids)}", command), box.put)
        out = box.get(timeout=timeout)
        assert isinstance(out, ControlResult)
        return out

    def check_kv_invariant(self) -> None:
        """Raises if KV slots leaked. Waits for the scheduler to go idle first."""
        deadline = time.monotonic() + 30
        while True:
            result = self.control("check_kv_invariant")
            if result.ok:
                return
            if result.error != "the scheduler is not idle" or time.monotonic() > deadline:
                raise AssertionError(f"KV accounting invariant failed: {result.error}")
            time.sleep(0.01)

    def get_stats(self) -> dict[str, Any]:
        return self.control("get_stats").payload

    def flush_cache(self) -> bool:
        return self.control("flush_cache").ok

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(ShutdownRequest())
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
