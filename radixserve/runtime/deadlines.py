"""--request-timeout: when each request in flight must have finished, and which ones are late.

The Engine asks between outputs (its reader thread wakes at least every POLL_MS), so a late
request is aborted within a fraction of a second of its deadline. The abort travels to the
scheduler like any other (every TP rank and DP replica sees it in order), which releases the KV.
"""

from __future__ import annotations

import heapq
import threading


class RequestDeadlines:
    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self._heap: list[tuple[float, str]] = []
        self._live: dict[str, float] = {}
        self._lock = threading.Lock()

    def start(self, rid: str, now: float) -> None:
        if self.timeout_s is None:
            return
        deadline = now + self.timeout_s
        with self._lock:
            self._live[rid] = deadline
            heapq.heappush(self._heap, (deadline, rid))

    def done(self, rid: str) -> None:
        if self.timeout_s is not None:
            with self._lock:
                self._live.pop(rid, None)

    def expired(self, now: float) -> list[str]:
        """The rids past their deadline and not done, each reported once."""
        late: list[str] = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                deadline, rid = heapq.heappop(self._heap)
                # A rid reused after it finished has a newer deadline: only its own counts.
                if self._live.get(rid) == deadline:
                    del self._live[rid]
                    late.append(rid)
        return late

    def __len__(self) -> int:
        return len(self._live)
