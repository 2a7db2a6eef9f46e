"""`--record-trace PATH`: the engine's own request trace, in the format `radixserve simulate
--trace-file` reads (simulator/trace.py, docs/simulator.md), so that a simulation can replay the
traffic a server really saw.

One JSON line per finished request, appended as it finishes:
- `arrival_s`: when the engine took the request, in seconds since the engine became ready to serve;
- `received_s`: when the scheduler took it, on the same clock, if it was idle then. An idle
  scheduler wakes on the first request and takes every request waiting by then at once: a
  simulation that replays these times forms the same first batch as the server did, however close
  together the arrivals were;
- `received_busy_s` instead, when the scheduler was busy (it takes requests between its steps).
  The simulation models a busy scheduler's receipts with its own step times, but learns from this
  one that a request which arrived before an idle receipt had not reached the scheduler by then;
- `first_output_s`: when the scheduler sent the request's first output, on the same clock. From
  `arrival_s`, the scheduler-side time to first token, which is what the simulator predicts; the
  engine's own adds the hops through the detokenizer. The simulator does not read it;
- `input_ids`: the prompt's token ids as scheduled (after chat templates, sessions, truncation and
  image expansion), so shared prefixes replay as shared; a prompt given as vectors (input_embeds)
  has no ids and is recorded by its length alone;
- `input_len`: the prompt's length (the loader's fallback when `input_ids` is absent);
- `output_len`: the tokens it generated;
- `finish`: how it ended ("stop", "length", "abort"). An aborted request (client gone, timeout,
  shutdown) is recorded with what it generated, as the load it put on the server; the simulator
  replays it as a shorter request. A request the scheduler refused (an abort carrying a 4xx status,
  e.g. an invalid grammar) was not served and is not recorded, like the engine's own refusals.

The engine's output thread only hands a finished request's line to a queue: a writer thread of
this module encodes and writes it, so a slow disk never holds up the event loop, the outputs of
other requests or the scheduler. Each line is one append to the file, so a killed server leaves
whole lines. The prompts' token ids are the users' text in another form: the trace is off unless
the operator asks for it, and a new file is readable by its owner only.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from radixserve.config.server_args import InvalidArgumentError
from radixserve.protocol.messages import FinishReason

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceLine:
    """One finished request, as simulate's trace loader reads it."""

    arrival_s: float
    input_ids: list[int] | None  # None: the prompt was vectors, only its length is known
    input_len: int
    output_len: int
    finish: str
    received_s: float | None = None
    received_idle: bool = False
    first_output_s: float | None = None

    def to_json(self) -> str:
        row: dict[str, object] = {"arrival_s": round(self.arrival_s, 6)}
        if self.received_s is not None:
            row["received_s" if self.received_idle else "received_busy_s"] = round(self.received_s, 6)
        if self.first_output_s is not None:
            row["first_output_s"] = round(self.first_output_s, 6)
        if self.input_ids is not None:
            row["input_ids"] = self.input_ids
        row.update(input_len=self.input_len, output_len=self.output_len, finish=self.finish)
        return json.dumps(row, separators=(",", ":"))


def is_refusal(finish: FinishReason) -> bool:
    """An abort that is the request's own fault (the scheduler's 4xx): it never ran."""
    return finish.type == "abort" and finish.status_code is not None and 400 <= finish.status_code < 500


class TraceRecorder:
    """Opens PATH for appending at once (a bad path fails before any model loads); records from
    start() on, the moment the engine is ready, which is where arrival times count from."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Owner-only, like any log of users' requests; O_APPEND with one write per line (below).
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            # A usage error (one line from `serve`), not a crash.
            raise InvalidArgumentError(f"--record-trace {path}: cannot append to it ({exc})") from exc
        self._started = time.monotonic()
        self._lock = threading.Lock()
        # rid -> (arrival_s, input_ids or None, input_len) until the request finishes.
        self._open: dict[str, tuple[float, list[int] | None, int]] = {}
        # rid -> (received_s, whether the scheduler was idle, first_output_s), from the request's
        # first output until it finishes.
        self._received: dict[str, tuple[float, bool, float | None]] = {}
        # None tells the writer to stop.
        self._lines: queue.SimpleQueue[TraceLine | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None

    def start(self) -> None:
        self._started = time.monotonic()
        self._writer = threading.Thread(target=self._write_lines, name="radixserve-trace", daemon=True)
        self._writer.start()
        logger.info("recording the request trace to %s", self.path)

    def submitted(self, rid: str, input_ids: list[int], input_len: int) -> None:
        """input_len differs from len(input_ids) only for a prompt of vectors (no ids)."""
        arrival_s = time.monotonic() - self._started
        # A copy: the trace must show the prompt as it was sent, whatever later holds the list.
        ids = list(input_ids) if input_ids else None
        with self._lock:
            self._open[rid] = (arrival_s, ids, input_len)

    def received(
        self, rid: str, received_at: float, idle: bool, first_output_at: float | None = None
    ) -> None:
        """The scheduler took the request at received_at (time.monotonic() in its process), idle
        or between two steps, and sent its first output at first_output_at."""
        first = None if first_output_at is None else first_output_at - self._started
        with self._lock:
            if rid in self._open:
                self._received[rid] = (received_at - self._started, idle, first)

    def finished(self, rid: str, output_len: int, finish: FinishReason) -> None:
        with self._lock:
            entry = self._open.pop(rid, None)
            received = self._received.pop(rid, None)
        if entry is None or is_refusal(finish):
            return
        arrival_s, ids, input_len = entry
        received_s, idle, first = (None, False, None) if received is None else received
        line = TraceLine(arrival_s, ids, input_len, output_len, finish.type, received_s, idle, first)
        self._lines.put(line)

    def forget(self, rid: str) -> None:
        """A request refused before it reached the scheduler: not part of the traffic served."""
        with self._lock:
            self._open.pop(rid, None)
            self._received.pop(rid, None)

    def close(self) -> None:
        """Writes the lines already queued, then closes the file."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._lines.put(None)
            writer.join(timeout=10)
            if writer.is_alive():
                return  # stuck on the disk: the file stays with the (daemon) writer
        os.close(self._fd)

    def _write_lines(self) -> None:
        failed = False
        while (line := self._lines.get()) is not None:
            if failed:
                continue  # drained unwritten, so that the queue cannot grow without bound
            data = (line.to_json() + "\n").encode()
            try:
                # One unbuffered write per line: nothing waits in a buffer, and a killed server
                # leaves whole lines (a short write only happens when the disk is full).
                if os.write(self._fd, data) != len(data):
                    raise OSError("short write (disk full?)")
            except OSError as exc:
                # A full disk must not take serving down: stop recording, and say so once.
                logger.error("stopped recording the request trace to %s: %s", self.path, exc)
                failed = True
