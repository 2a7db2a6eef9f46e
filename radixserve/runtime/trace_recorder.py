"""`--record-trace PATH`: the engine's own request trace, in the format `radixserve simulate
--trace-file` reads (docs/simulator.md), so that a simulation can replay the traffic a server
really saw.

One JSON line per finished request, appended as it finishes:
- `arrival_s`: when the engine took the request, in seconds since the engine started;
- `input_ids`: the prompt's token ids as scheduled (so shared prefixes replay as shared);
- `output_len`: the tokens it generated;
- `finish`: how it ended ("stop", "length", "abort"). An aborted request is recorded with what
  it generated, as the load it put on the server; the simulator replays it as a shorter request.

Lines are written by the engine's output thread (never the scheduler's, never the event loop's)
and flushed one by one, so a killed server leaves whole lines. The prompts' token ids are the
users' text in another form: the trace is off unless the operator asks for it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)


class TraceRecorder:
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._started = time.monotonic()
        self._lock = threading.Lock()
        # rid -> (arrival_s, input_ids) until the request finishes.
        self._open: dict[str, tuple[float, list[int]]] = {}
        logger.info("recording the request trace to %s", self.path)

    def submitted(self, rid: str, input_ids: list[int]) -> None:
        with self._lock:
            self._open[rid] = (time.monotonic() - self._started, list(input_ids))

    def finished(self, rid: str, output_len: int, finish: str) -> None:
        with self._lock:
            entry = self._open.pop(rid, None)
            if entry is None or self._file.closed:
                return
            arrival_s, input_ids = entry
            row = {"arrival_s": round(arrival_s, 6), "input_ids": input_ids, "output_len": output_len}
            self._file.write(json.dumps({**row, "finish": finish}) + "\n")
            self._file.flush()

    def forget(self, rid: str) -> None:
        """A request refused before it ran (never scheduled): not part of the traffic served."""
        with self._lock:
            self._open.pop(rid, None)

    def close(self) -> None:
        with self._lock:
            self._file.close()
