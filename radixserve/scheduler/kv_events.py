"""Publishing KV cache events over ZMQ, as vLLM and SGLang do (--kv-events-config).

The radix cache records what it stores and removes (cache/kv_events.py); once per scheduler step
the events so far become one KVEventBatch, which a thread of its own encodes (msgpack) and sends
on a PUB socket as three frames: topic, an 8-byte big-endian sequence number, the payload. The
last `buffer_steps` batches are kept: a subscriber that sees a gap in the sequence numbers sends
the first number it missed (8 bytes, big-endian) to the ROUTER replay socket and gets every kept
batch from there on as (sequence, payload) frames, then (-1, empty) for the end. Only the first
tensor-parallel rank publishes (the others hold the same cache); data-parallel replica r publishes
on the endpoint's port + r (an ipc:// or inproc:// name gets "_dp<r>").

The scheduler never waits on it: the queue to the thread is bounded (max_queue_size) and a batch
that finds it full is dropped, logged once and counted.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from urllib.parse import urlsplit

import msgspec
import zmq

from radixserve.cache.kv_events import KVEventBatch, KVEventRecorder
from radixserve.config.kv_events_args import KVEventsConfig

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# Hosts a tcp:// endpoint binds to (this process is the publisher, the stable end); any other host
# is a remote collector, connected to, as vLLM does.
_BIND_HOSTS = frozenset({"*", "0.0.0.0", "::", "127.0.0.1", "localhost", "::1"})


def replica_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint data-parallel replica dp_rank publishes on."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{dp_rank}"
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + dp_rank}"


def binds(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return True
    return urlsplit(endpoint).hostname in _BIND_HOSTS


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, page_size: int, medium: str, dp_rank: int = 0) -> None:
        self.recorder = KVEventRecorder(page_size, medium)
        self.dp_rank = dp_rank
        self.endpoint = replica_endpoint(config.endpoint, dp_rank)
        self.replay_endpoint = (
            replica_endpoint(config.replay_endpoint, dp_rank) if config.replay_endpoint else None
        )
        self.topic = config.topic.encode()
        self.published = 0
        self.dropped = 0
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(self.endpoint) if binds(self.endpoint) else self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise RuntimeError(f"--kv-events-config: cannot open {self.endpoint}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "KV cache events: publishing on %s%s",
            self.endpoint,
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
        )

    def flush(self) -> None:
        """Hand the events recorded since the last flush to the publishing thread."""
        batch = self.recorder.take(self.dp_rank)
        if batch is None:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            if self.dropped == 0:
                logger.warning("KV cache events: the publishing queue is full; dropping batches")
            self.dropped += 1

    def shutdown(self) -> None:
        """Publish what is queued (within a second), then close."""
        self.flush()
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout=1.0)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._kept.append((seq, payload))
            self.published += 1
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        # [identity, empty delimiter, first sequence number] from a REQ socket.
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV cache events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        identity, first = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))
