"""Engine: the offline Python API.

The scheduler runs in its own process (see scheduler/process.py) and talks to the engine over ZMQ
IPC sockets with typed messages. Callers submit requests from any thread (generate) or from asyncio
(async_stream); a reader thread routes the scheduler's outputs to per-request queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq

from radixserve.args import ServerArgs
from radixserve.detokenize import IncrementalDetokenizer
from radixserve.ipc import Channel, IpcDir
from radixserve.log import configure_logging
from radixserve.messages import (
    AbortRequest,
    ControlRequest,
    ControlResult,
    GenerateRequest,
    ReqOutput,
    SchedulerFailed,
    SchedulerInput,
    SchedulerOutput,
    SchedulerReady,
    ShutdownRequest,
)
from radixserve.model.loader import ModelSource, load_tokenizer, resolve_model_source
from radixserve.sampling_params import InvalidRequestError

logger = logging.getLogger("radixserve")

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None


class EngineDeadError(RuntimeError):
    """The scheduler thread stopped with an error; the engine cannot serve more requests."""


# Where one request's outputs go: a thread-safe callback set by the waiting caller.
Deliver = Callable[[SchedulerOutput], None]


# How long the scheduler process may take to load the model and report ready.
STARTUP_TIMEOUT_S = 600
# How often the output reader wakes up to check that the scheduler process is alive.
READER_POLL_MS = 200


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any):
        self.args = ServerArgs(model_path=model_path, **server_args)
        configure_logging(self.args.log_level)
        self.source: ModelSource = resolve_model_source(self.args.model_path)
        # The scheduler process loads exactly what was resolved here (no second hub lookup).
        self.args.model_path = str(self.source.path)
        tokenizer_source = (
            resolve_model_source(self.args.tokenizer_path) if self.args.tokenizer_path else self.source
        )
        self.tokenizer = load_tokenizer(tokenizer_source)
        self._pending: dict[str, Deliver] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._error: str | None = None
        self._closing = False
        self._ids = itertools.count()

        self._ipc = IpcDir()
        self._zmq: zmq.Context[Any] = zmq.Context()
        inbox, outbox = self._ipc.address("scheduler-in"), self._ipc.address("scheduler-out")
        self._to_scheduler = Channel(self._zmq, inbox, send=True, bind=True)
        self._from_scheduler = Channel(self._zmq, outbox, send=False, bind=True)
        # A fresh interpreter rather than multiprocessing: nothing is pickled, and the caller's
        # __main__ module is never re-imported (no `if __name__ == "__main__"` guard needed).
        self._process = subprocess.Popen(
            [
                sys.executable, "-m", "radixserve.scheduler.process",
                "--server-args-json", json.dumps(self.args.to_dict()),
                "--inbox", inbox, "--outbox", outbox, "--parent-pid", str(os.getpid()),
            ]
        )  # fmt: skip
        try:
            ready = self._wait_ready()
        except BaseException:
            self._close_process()
            raise
        self.max_total_tokens = ready.max_total_tokens
        self.context_len = ready.context_len
        logger.info("scheduler ready: KV cache holds %d tokens", ready.max_total_tokens)
        self._reader = threading.Thread(target=self._read_outputs, name="radixserve-outputs", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ scheduler process

    def _wait_ready(self) -> SchedulerReady:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            msg = self._from_scheduler.recv(READER_POLL_MS)
            if isinstance(msg, SchedulerReady):
                return msg
            if isinstance(msg, SchedulerFailed):
                raise EngineDeadError(f"the scheduler failed to start:\n{msg.error}")
            if self._process.poll() is not None:
                raise EngineDeadError(
                    f"the scheduler process exited with code {self._process.returncode} at start"
                )
        raise EngineDeadError(f"the scheduler did not become ready within {STARTUP_TIMEOUT_S}s")

    def _read_outputs(self) -> None:
        while not self._closing:
            msg = self._from_scheduler.recv(READER_POLL_MS)
            if isinstance(msg, (ReqOutput, ControlResult)):
                self._dispatch([msg])
            elif isinstance(msg, SchedulerFailed):
                self._fail(f"the scheduler stopped with an error:\n{msg.error}")
                return
            elif msg is None and self._process.poll() is not None and not self._closing:
                self._fail(f"the scheduler process died (exit code {self._process.returncode})")
                return

    def _fail(self, error: str) -> None:
        logger.error("%s", error)
        with self._lock:
            self._error = error
            pending = list(self._pending.values())
            self._pending.clear()
        for deliver in pending:
            with contextlib.suppress(Exception):  # a receiver that is gone cannot be told
                deliver(ControlResult("", False, error=f"engine died: {error}"))

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
                    pending(out)
                except Exception:
                    # A caller that went away (closed event loop) must not take the reader down.
                    logger.warning("dropped an output for %s: its receiver is gone", out.rid)

    def _send(self, msg: SchedulerInput) -> None:
        # A PUSH socket blocks while its peer is away: wait in slices and give up if it died.
        with self._send_lock:
            while not self._to_scheduler.send(msg, timeout_ms=READER_POLL_MS):
                if self._process.poll() is not None:
                    raise EngineDeadError(
                        f"the scheduler process died (exit code {self._process.returncode})"
                    )

    def _submit(self, msg: SchedulerInput, deliver: Callable[[SchedulerOutput], None]) -> None:
        rid = msg.rid if isinstance(msg, (GenerateRequest, ControlRequest)) else None
        # Checked under the lock _fail takes, so a request is either refused here or failed there.
        with self._lock:
            if self._error is not None or self._closing:
                raise EngineDeadError(f"the engine is not running: {self._error or 'shut down'}")
            if rid is not None:
                self._pending[rid] = deliver
        try:
            self._send(msg)
        except EngineDeadError:
            with self._lock:
                self._pending.pop(rid or "", None)
            raise

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
        self._send(AbortRequest(rid=rid, abort_all=abort_all))

    def control(self, command: str, timeout: float = 60.0) -> ControlResult:
        box: queue.Queue[SchedulerOutput] = queue.Queue()
        self._submit(ControlRequest(f"ctl-{next(self._ids)}", command), box.put)
        out = box.get(timeout=timeout)
        assert isinstance(out, ControlResult)
        return out

    def check_kv_invariant(self, timeout: float = 60.0) -> None:
        """Raises if KV slots leaked. The scheduler answers once it is idle."""
        result = self.control("check_kv_invariant", timeout=timeout)
        if not result.ok:
            raise AssertionError(f"KV accounting invariant failed: {result.error}")

    def get_stats(self) -> dict[str, Any]:
        return self.control("get_stats").payload

    def flush_cache(self) -> bool:
        return self.control("flush_cache").ok

    def shutdown(self) -> None:
        if self._closing:
            return
        if self._process.poll() is None and self._error is None:
            with contextlib.suppress(EngineDeadError):
                self._send(ShutdownRequest())
        self._closing = True
        self._reader.join(timeout=5)
        self._close_process()

    def _close_process(self) -> None:
        self._closing = True
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._to_scheduler.close()
        self._from_scheduler.close()
        self._zmq.term()
        self._ipc.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
