"""Moving a prompt's K/V from a prefill server to a decode server (prefill/decode disaggregation).

The transport is torch.distributed's, never a socket protocol of radixserve's own:
- **Bootstrap:** a prefill server hosts a `TCPStore` on its --disaggregation-bootstrap-port. A
  decode server that is sent a request naming that host and port joins the store, takes a peer
  number from a counter in it, and the two build a two-rank gloo group of their own (a
  `PrefixStore` per pair), so any number of decode servers can pair with one prefill server.
- **Rooms:** sglang-router gives both halves of a request the same `bootstrap_room`. The decode
  server claims a room in the store once it has KV slots for the prompt (that is its flow
  control); the prefill server sends a finished prompt's K/V only to the peer that claimed its room,
  taking the claim out of the store as it starts. A decode server that gives up on a room turns its
  claim into a give-up mark, atomically and only while the claim is still there (a claim already
  taken means the K/V is on its way, and the decode side drops it on arrival); the prefill side
  drops a room so marked. So a mark never outlives the request it was for, and a room number used
  again later is never dropped by an earlier request's abort. (A room given up before it was ever
  claimed is marked outright; the prefill side clears the mark when it drops the room.)
- **One handoff** on the pair's group: a fixed header (int64), a JSON record (the first token and
  its logprobs, the K/V's shape and dtype, or why the prefill side gave up), then the K/V bytes.

Each side does its network work on its own thread; the scheduler only queues work and polls results.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

logger = logging.getLogger("radixserve.kv_transfer")

_MAGIC = 0x52535044  # "RSPD"
_HEADER_LEN = 6
_STATUS_KV, _STATUS_ABORTED, _STATUS_CLOSE = 0, 1, 2
# A pair's group outlives many idle minutes; a dead peer ends a receive by closing its socket.
_GROUP_TIMEOUT = datetime.timedelta(days=1)
_CONNECT_TIMEOUT = datetime.timedelta(seconds=30)
# How often the prefill side looks for new peers and for claimed or abandoned rooms.
_POLL_S = 0.005
_PREFIX = "radixserve/pd"


def _room_key(room: int) -> str:
    return f"{_PREFIX}/room/{room}"


# The value of a room's key once the decode side gave it up (a claim's value is a peer number).
_GIVEN_UP = "given-up"


def layout_signature(kv_shape_per_token: tuple[int, ...], dtype: torch.dtype) -> str:
    """What both sides must agree on: layers, 2, kv heads, head dim, dtype."""
    return json.dumps({"shape": list(kv_shape_per_token), "dtype": str(dtype).removeprefix("torch.")})


@dataclass
class KVHandoff:
    """One request's prompt K/V and first token, or (kv None) the news that a side gave it up."""

    room: int
    kv: torch.Tensor | None  # [num_layers, 2, prompt_len, kv_heads, head_dim]
    first_token: int = -1
    # The first token's logprobs as the request asked for them (TokenLogprobs fields), or None.
    logprobs: dict[str, Any] | None = None
    message: str = ""


@dataclass
class TransferStats:
    handoffs: int = 0
    failed: int = 0
    # Prefill side: finished prompts the decode side gave up before they were sent.
    dropped: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "handoffs": self.handoffs,
            "failed": self.failed,
            "dropped": self.dropped,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 6),
        }


class PrefillTransfer(ABC):
    """The prefill side: hands finished prompts to whichever decode server claims their room."""

    @abstractmethod
    def send(self, handoff: KVHandoff) -> None:
        """Queues a handoff (never blocks); it is dropped if nobody claims the room in time."""

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def close(self) -> None: ...


class DecodeTransfer(ABC):
    """The decode side: claims rooms, receives their K/V."""

    @abstractmethod
    def expect(self, room: int, host: str, port: int) -> None:
        """Claims a room on the prefill server at host:port (never blocks)."""

    @abstractmethod
    def forget(self, room: int, host: str, port: int) -> None:
        """Gives a room up: the prefill server drops its K/V, and whatever still arrives is dropped."""

    @abstractmethod
    def poll(self) -> list[KVHandoff]:
        """Handoffs received (or failed) since the last poll."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Returns when a handoff is ready to poll, or after timeout_s."""

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def close(self) -> None: ...


def _pair_group(store: Store, peer: int, rank: int, device_host: str | None) -> Any:
    """The two-rank gloo group of one prefill/decode pair; blocks until both sides build it."""
    options: Any = getattr(ProcessGroupGloo, "_Options")()  # noqa: B009 (untyped in torch's stubs)
    options._timeout = _GROUP_TIMEOUT
    device = (
        ProcessGroupGloo.create_device(hostname=device_host)
        if device_host
        else ProcessGroupGloo.create_default_device()
    )
    options._devices = [device]
    return ProcessGroupGloo(PrefixStore(f"{_PREFIX}/pair/{peer}", store), rank, 2, options)


def _device_host(bind_host: str) -> str | None:
    """The address gloo binds for this server: its own bind address, unless that is a wildcard."""
    return None if bind_host in ("", "0.0.0.0", "::") else bind_host


def _send_handoff(group: Any, handoff: KVHandoff) -> int:
    """Header, record, K/V bytes, in that order on the pair's group; returns the bytes sent."""
    record: dict[str, Any] = {"first_token": handoff.first_token, "logprobs": handoff.logprobs}
    payload = None
    if handoff.kv is not None:
        kv = handoff.kv.contiguous()
        record["shape"], record["dtype"] = list(kv.shape), str(kv.dtype).removeprefix("torch.")
        payload = kv.view(-1).view(torch.uint8)
    else:
        record["message"] = handoff.message
    meta = torch.frombuffer(bytearray(json.dumps(record).encode()), dtype=torch.uint8)
    status = _STATUS_KV if payload is not None else _STATUS_ABORTED
    header = torch.tensor(
        [_MAGIC, status, handoff.room >> 32, handoff.room & 0xFFFFFFFF, meta.numel(),
         0 if payload is None else payload.numel()],
        dtype=torch.int64,
    )  # fmt: skip
    group.send([header], 1, 0).wait()
    group.send([meta], 1, 0).wait()
    if payload is not None:
        group.send([payload], 1, 0).wait()
    return int(header.numel() * 8 + meta.numel() + (0 if payload is None else payload.numel()))


def _receive_handoff(group: Any) -> tuple[KVHandoff | None, float]:
    """The inverse of _send_handoff; None when the prefill side closed the pair. Also the seconds
    it took from the header's arrival."""
    header = torch.empty(_HEADER_LEN, dtype=torch.int64)
    group.recv([header], 0, 0).wait()
    started = time.perf_counter()
    magic, status, room_hi, room_lo, meta_len, kv_len = (int(x) for x in header)
    if magic != _MAGIC:
        raise RuntimeError(f"the prefill server sent a header with magic {magic:#x}: not radixserve's")
    if status == _STATUS_CLOSE:
        return None, 0.0
    room = (room_hi << 32) | room_lo
    meta = torch.empty(meta_len, dtype=torch.uint8)
    group.recv([meta], 0, 0).wait()
    record = json.loads(bytes(meta.numpy()).decode())
    if status == _STATUS_ABORTED:
        message = record.get("message", "the prefill server gave the request up")
        return KVHandoff(room, None, message=message), time.perf_counter() - started
    payload = torch.empty(kv_len, dtype=torch.uint8)
    group.recv([payload], 0, 0).wait()
    dtype = getattr(torch, record["dtype"])
    kv = payload.view(dtype).view(record["shape"])
    handoff = KVHandoff(room, kv, int(record["first_token"]), record.get("logprobs"))
    return handoff, time.perf_counter() - started


@dataclass
class _Pending:
    handoff: KVHandoff
    deadline: float


class GlooPrefillTransfer(PrefillTransfer):
    """The prefill side over torch.distributed: a TCPStore for bootstrap, gloo pairs for K/V."""

    def __init__(self, bind_host: str, port: int, layout: str, timeout_s: float):
        self.store = TCPStore(
            bind_host or "0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=_CONNECT_TIMEOUT
        )
        self.store.set(f"{_PREFIX}/layout", layout)
        self.device_host = _device_host(bind_host)
        self.timeout_s = timeout_s
        self.peers: dict[int, Any] = {}
        self._inbox: queue.Queue[KVHandoff | None] = queue.Queue()
        self._pending: dict[int, _Pending] = {}
        self._queued = 0  # handed to send() and not yet in _pending
        self._stats = TransferStats()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="radixserve-pd-send", daemon=True)
        self._thread.start()
        logger.info("prefill/decode bootstrap: TCPStore on %s:%d, K/V over gloo", bind_host, port)

    def send(self, handoff: KVHandoff) -> None:
        with self._lock:
            self._queued += 1  # counted from here on, so that stats never miss it
        self._inbox.put(handoff)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self._stats.as_dict(),
                "peers": len(self.peers),
                "waiting_for_claim": self._queued + len(self._pending),
            }

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=_POLL_S)
            except queue.Empty:
                pass  # nothing new: look at the store again
            else:
                if item is None:
                    self._close_peers()
                    return
                with self._lock:
                    self._queued -= 1
                    self._pending[item.room] = _Pending(item, time.monotonic() + self.timeout_s)
            try:
                self._accept_peers()
                self._send_claimed()
            except Exception:  # a broken store or peer must not end the thread that serves the rest
                logger.exception("prefill/decode transfer failed")

    def _accept_peers(self) -> None:
        joined = self.store.add(f"{_PREFIX}/peers", 0)
        for peer in range(len(self.peers), joined):
            self.peers[peer] = _pair_group(self.store, peer, 0, self.device_host)
            logger.info("decode server %d joined for K/V transfer", peer)

    def _send_claimed(self) -> None:
        now = time.monotonic()
        for room, pending in list(self._pending.items()):
            # Only this side deletes room keys, so a key seen here is still there to read.
            value = self.store.get(_room_key(room)).decode() if self.store.check([_room_key(room)]) else None
            if value == _GIVEN_UP:
                self.store.delete_key(_room_key(room))
                self._settle(room, "dropped")
                continue
            if value is None:
                if now > pending.deadline:
                    logger.warning(
                        "no decode server claimed room %d in %.0f s; dropping it", room, self.timeout_s
                    )
                    self._settle(room, "failed")
                continue
            peer = int(value)
            group = self.peers.get(peer)
            if group is None:
                continue  # it claimed the room before we accepted it: next round
            self.store.delete_key(_room_key(room))
            started = time.perf_counter()
            try:
                sent = _send_handoff(group, pending.handoff)
            except Exception:
                logger.exception("sending room %d to decode server %d failed", room, peer)
                self._settle(room, "failed")
                continue
            self._settle(room, "handoffs", sent, time.perf_counter() - started)

    def _settle(self, room: int, outcome: str, sent: int = 0, seconds: float = 0.0) -> None:
        """A room leaves the queue and is counted in one step, so that stats never show it in
        neither place (a room stays queued while it is being sent)."""
        with self._lock:
            del self._pending[room]
            setattr(self._stats, outcome, getattr(self._stats, outcome) + 1)
            self._stats.bytes += sent
            self._stats.seconds += seconds

    def _close_peers(self) -> None:
        close = torch.tensor([_MAGIC, _STATUS_CLOSE, 0, 0, 0, 0], dtype=torch.int64)
        for peer, group in self.peers.items():
            try:
                group.send([close], 1, 0).wait()
            except Exception:
                logger.info("decode server %d was gone at shutdown", peer)
        self.peers.clear()


@dataclass
class _Connection:
    """A decode server's pairing with one prefill server."""

    store: Any
    peer: int
    group: Any
    rooms: set[int] = field(default_factory=set)
    # Set (under the transfer's lock) when the prefill side closed the pair: a room expected
    # after that fails at once, as its receiver has already failed the others and stopped.
    closed: bool = False


class GlooDecodeTransfer(DecodeTransfer):
    """The decode side over torch.distributed: joins prefill servers' stores as requests name them."""

    def __init__(self, bind_host: str, layout: str):
        self.device_host = _device_host(bind_host)
        self.layout = layout
        self._connections: dict[tuple[str, int], _Connection] = {}
        self._commands: queue.Queue[tuple[str, int, str, int] | None] = queue.Queue()
        self._ready: collections.deque[KVHandoff] = collections.deque()
        self._forgotten: set[int] = set()
        # Rooms claimed (expected) and not yet handed to the scheduler: a room given up while
        # here has a claim in the store to turn into a give-up mark.
        self._claimed: set[int] = set()
        self._cond = threading.Condition()
        self._stats = TransferStats()
        self._thread = threading.Thread(target=self._run, name="radixserve-pd-connect", daemon=True)
        self._thread.start()

    def expect(self, room: int, host: str, port: int) -> None:
        with self._cond:
            self._forgotten.discard(room)  # a room given up earlier, used again
            self._claimed.add(room)
        self._commands.put(("expect", room, host, port))

    def forget(self, room: int, host: str, port: int) -> None:
        with self._cond:
            self._forgotten.add(room)
            # K/V that came and was not yet polled belongs to the request given up, not to one
            # that uses the room next.
            self._ready = collections.deque(handoff for handoff in self._ready if handoff.room != room)
            kind = "forget-claimed" if room in self._claimed else "forget-unclaimed"
            self._claimed.discard(room)
        self._commands.put((kind, room, host, port))

    def poll(self) -> list[KVHandoff]:
        with self._cond:
            ready, self._ready = list(self._ready), collections.deque()
            self._claimed.difference_update(handoff.room for handoff in ready)
            return ready

    def wait(self, timeout_s: float) -> None:
        with self._cond:
            if not self._ready:
                self._cond.wait(timeout_s)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {**self._stats.as_dict(), "prefill_servers": len(self._connections)}

    def close(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    def _deliver(self, handoff: KVHandoff) -> None:
        with self._cond:
            if handoff.room in self._forgotten:
                self._forgotten.discard(handoff.room)
                return
            self._ready.append(handoff)
            self._cond.notify_all()

    def _run(self) -> None:
        while (command := self._commands.get()) is not None:
            kind, room, host, port = command
            try:
                connection = self._connect(host, port)
                if kind == "expect":
                    with self._cond:
                        if not connection.closed:
                            connection.rooms.add(room)
                    if connection.closed:
                        self._deliver(KVHandoff(room, None, message="the prefill server closed"))
                        continue
                    connection.store.set(_room_key(room), str(connection.peer))
                else:
                    connection.rooms.discard(room)
                    # A claim already taken means the K/V is on its way: nothing to mark.
                    expected = str(connection.peer) if kind == "forget-claimed" else ""
                    connection.store.compare_set(_room_key(room), expected, _GIVEN_UP)
            except Exception as exc:
                logger.warning("prefill server %s:%d: %s", host, port, exc)
                with self._cond:
                    self._connections.pop((host, port), None)
                if kind == "expect":
                    message = f"cannot reach the prefill server's bootstrap at {host}:{port}: {exc}"
                    self._deliver(KVHandoff(room, None, message=message))

    def _connect(self, host: str, port: int) -> _Connection:
        connection = self._connections.get((host, port))
        if connection is not None:
            return connection
        store = TCPStore(host, port, is_master=False, timeout=_CONNECT_TIMEOUT)
        theirs = store.get(f"{_PREFIX}/layout").decode()
        if theirs != self.layout:
            raise RuntimeError(
                f"the prefill server's K/V layout {theirs} differs from this server's {self.layout}"
            )
        peer = store.add(f"{_PREFIX}/peers", 1) - 1
        group = _pair_group(store, peer, 1, self.device_host)
        connection = _Connection(store, peer, group)
        self._connections[(host, port)] = connection
        threading.Thread(
            target=self._receive, args=(connection, host, port), name="radixserve-pd-recv", daemon=True
        ).start()
        logger.info("joined the prefill server at %s:%d as peer %d", host, port, peer)
        return connection

    def _receive(self, connection: _Connection, host: str, port: int) -> None:
        while True:
            error: Exception | None = None
            try:
                handoff, seconds = _receive_handoff(connection.group)
            except Exception as exc:
                handoff, seconds, error = None, 0.0, exc
            if handoff is None:
                # Closed or broken: every room still expected there fails, and a later request
                # naming this server connects again.
                reason = "the prefill server closed" if error is None else f"K/V transfer failed: {error}"
                with self._cond:
                    connection.closed = True
                    if self._connections.get((host, port)) is connection:
                        del self._connections[(host, port)]
                    rooms = list(connection.rooms)
                    connection.rooms.clear()
                for room in rooms:
                    self._deliver(KVHandoff(room, None, message=reason))
                return
            connection.rooms.discard(handoff.room)
            with self._cond:
                if handoff.kv is not None:
                    self._stats.handoffs += 1
                    self._stats.bytes += handoff.kv.numel() * handoff.kv.element_size()
                    self._stats.seconds += seconds
                else:
                    self._stats.failed += 1
            self._deliver(handoff)
