"""Sessions: multi-turn requests that continue from (or branch off) earlier requests of a session.

A session remembers, per finished request, its whole token sequence (prompt + output) and the
request it continued from. A new request with session_params {id, rid, offset, replace} gets as its
prompt the sequence of request `rid` (default: the session's latest), cut to `offset` tokens
(default: all of it), followed by its own tokens. The KV of that prefix is reused through the radix
cache, like any shared prefix: it is not pinned, so under memory pressure part of it may be evicted
and recomputed, which changes speed but never the output.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.protocol.sampling_params import InvalidRequestError


@dataclass
class Turn:
    rid: str
    parent: str | None
    tokens: list[int]  # prompt + output


@dataclass
class Session:
    id: str
    turns: dict[str, Turn] = field(default_factory=dict)
    latest: str | None = None


@dataclass
class SessionParams:
    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SessionParams:
        unknown = set(raw) - {"id", "rid", "offset", "replace"}
        if unknown or not isinstance(raw.get("id"), str):
            raise InvalidRequestError('session_params must be {"id": str, "rid"?, "offset"?, "replace"?}')
        offset = raw.get("offset")
        if offset is not None and (not isinstance(offset, int) or offset < 0):
            raise InvalidRequestError(f"session_params.offset must be a non-negative integer, got {offset!r}")
        return cls(raw["id"], raw.get("rid"), offset, bool(raw.get("replace", False)))


class SessionStore:
    """Thread-safe: requests finish on the engine's reader side while others start."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, session_id: str | None = None) -> str:
        with self._lock:
            session_id = session_id or uuid.uuid4().hex
            if session_id in self._sessions:
                raise InvalidRequestError(f"session {session_id!r} is already open")
            self._sessions[session_id] = Session(session_id)
            return session_id

    def close(self, session_id: str) -> None:
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
                raise InvalidRequestError(f"session {session_id!r} is not open")

    def prompt(self, params: SessionParams, new_ids: list[int]) -> tuple[list[int], str | None]:
        """The full prompt of a session request, and the rid it continues from (None: the first)."""
        with self._lock:
            session = self._session(params.id)
            parent_rid = params.rid if params.rid is not None else session.latest
            if parent_rid is None:
                return list(new_ids), None
            parent = session.turns.get(parent_rid)
            if parent is None:
                raise InvalidRequestError(
                    f"request {parent_rid!r} is not a finished request of session {params.id!r}"
                )
            offset = len(parent.tokens) if params.offset is None else params.offset
            if offset > len(parent.tokens):
                raise InvalidRequestError(
                    f"session_params.offset {offset} is past the end of request {parent_rid!r} "
                    f"({len(parent.tokens)} tokens)"
                )
            if params.replace:
                self._drop_descendants(session, parent_rid)
            return parent.tokens[:offset] + list(new_ids), parent_rid

    def record(self, session_id: str, rid: str, parent: str | None, tokens: list[int]) -> None:
        """Remembers a finished request (a closed session forgets it)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                session.turns[rid] = Turn(rid, parent, tokens)
                session.latest = rid

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise InvalidRequestError(f"session {session_id!r} is not open (open it first, or it was closed)")
        return session

    @staticmethod
    def _drop_descendants(session: Session, rid: str) -> None:
        doomed = {rid}
        changed = True
        while changed:
            changed = False
            for turn in list(session.turns.values()):
                if turn.parent in doomed and turn.rid not in doomed:
                    doomed.add(turn.rid)
                    changed = True
        for gone in doomed - {rid}:
            del session.turns[gone]
        if session.latest not in session.turns:
            session.latest = rid
