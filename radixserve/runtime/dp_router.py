"""Data parallelism (--dp-size N): which scheduler replica serves each request.

The engine process routes as it submits (no extra process or hop: SGLang's data-parallel
controller sits between its tokenizer and schedulers; here the tokenizer side is the engine).

- round_robin: replicas in turn.
- shortest_queue: the replica with the least outstanding work, counted in tokens as the seed's
  get_load counts a replica's load (tokens in its KV cache plus those its waiting requests need):
  for every request sent there and not yet finished, its prompt plus the output it may still make.
  The engine keeps that count from what it sends and what comes back, so no polling is needed.
- cache_aware: the replica that last served the longest prefix of the prompt (in 64-token blocks),
  so that requests sharing a prefix meet its KV in one radix cache; shortest_queue when none did,
  or when that replica is too far ahead of the least loaded one (more than BALANCE_REL times its
  outstanding tokens plus BALANCE_ABS): one shared prompt must not pile every request on one replica.

Requests of one session always go to the replica of the session's earlier requests, where their
history's KV is cached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from radixserve.config.parallel_args import LOAD_BALANCE_METHODS
from radixserve.protocol.messages import GenerateRequest

PREFIX_BLOCK = 64
BALANCE_ABS = 4096
BALANCE_REL = 1.5
# Prefix blocks remembered for cache-aware routing (least recently used ones are forgotten).
MAX_REMEMBERED_PREFIXES = 100_000


@dataclass
class _InFlight:
    replica: int
    tokens: int


class Router:
    def __init__(self, num_replicas: int, method: str = "round_robin"):
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"unknown load balance method {method!r}; choose from {LOAD_BALANCE_METHODS}")
        self.num_replicas = num_replicas
        self.method = method
        self.outstanding = [0] * num_replicas  # tokens, see the module docstring
        self.served = [0] * num_replicas  # requests routed to each replica so far
        self._next = 0
        self._in_flight: dict[str, _InFlight] = {}
        self._sessions: dict[str, int] = {}
        self._prefixes: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def pick(self, req: GenerateRequest) -> int:
        """The replica for a new request; it counts as outstanding there until done(rid)."""
        with self._lock:
            replica = self._choose(req)
            tokens = len(req.input_ids) + req.sampling_params.max_new_tokens
            self._in_flight[req.rid] = _InFlight(replica, tokens)
            self.outstanding[replica] += tokens
            self.served[replica] += 1
            if req.session_id is not None:
                self._sessions[req.session_id] = replica
            if self.method == "cache_aware":
                self._remember_prefixes(req.input_ids, replica)
            return replica

    def done(self, rid: str) -> None:
        with self._lock:
            flight = self._in_flight.pop(rid, None)
            if flight is not None:
                self.outstanding[flight.replica] -= flight.tokens

    def forget_session(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def _choose(self, req: GenerateRequest) -> int:
        if req.session_id is not None and req.session_id in self._sessions:
            return self._sessions[req.session_id]
        if self.method == "round_robin":
            replica = self._next
            self._next = (self._next + 1) % self.num_replicas
            return replica
        least = min(range(self.num_replicas), key=lambda r: (self.outstanding[r], r))
        if self.method == "cache_aware":
            cached = self._longest_prefix_replica(req.input_ids)
            limit = BALANCE_REL * self.outstanding[least] + BALANCE_ABS
            if cached is not None and self.outstanding[cached] <= limit:
                return cached
        return least

    def _prefix_keys(self, ids: list[int]) -> list[int]:
        return [hash(tuple(ids[:end])) for end in range(PREFIX_BLOCK, len(ids) + 1, PREFIX_BLOCK)]

    def _longest_prefix_replica(self, ids: list[int]) -> int | None:
        for key in reversed(self._prefix_keys(ids)):
            if key in self._prefixes:
                return self._prefixes[key]
        return None

    def _remember_prefixes(self, ids: list[int], replica: int) -> None:
        for key in self._prefix_keys(ids):
            self._prefixes[key] = replica
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > MAX_REMEMBERED_PREFIXES:
            self._prefixes.popitem(last=False)


# Per-replica figures that are rates or fractions: averaged, not added, across replicas.
_AVERAGED = frozenset(
    {
        "token_usage",
        "cache_hit_rate",
        "new_token_ratio",
        "inter_token_latency",
        "time_to_first_token",
        "avg_spec_accept_length",
        "spec_accept_rate",
    }
)
# Settings every replica shares: taken from the first.
_SHARED = frozenset({"max_total_tokens", "context_len"})


def merge_replica_payloads(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer for a control command from every replica's: counts add up, rates average, flags
    must hold everywhere; the replicas' own answers are kept under "dp_replicas"."""
    merged = {key: _merge_values(key, [p.get(key) for p in payloads]) for key in payloads[0]}
    merged["dp_replicas"] = payloads
    return merged


def _merge_values(key: str, values: list[Any]) -> Any:
    if key == "kv_invariant":
        bad = [f"dp rank {i}: {v}" for i, v in enumerate(values) if v != "ok"]
        return "; ".join(bad) if bad else "ok"
    if all(isinstance(v, bool) for v in values):
        return all(values)
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if key in _SHARED or len(numbers) != len(values):
        return values[0]
    if key in _AVERAGED:
        return sum(numbers) / len(numbers)
    return sum(numbers)
