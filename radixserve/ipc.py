"""Typed messages over ZMQ IPC sockets: msgpack via msgspec, never pickle.

Each message travels as two frames: its type name and its msgpack body. The sockets live in a
private temporary directory (mode 0700), so only this user's processes on this machine reach them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import msgspec
import zmq

from radixserve.messages import (
    AbortRequest,
    ControlRequest,
    ControlResult,
    GenerateRequest,
    OutputBatch,
    SchedulerFailed,
    SchedulerReady,
    ShutdownRequest,
    TextBatch,
)

_TYPES: dict[str, type[Any]] = {
    cls.__name__: cls
    for cls in (
        GenerateRequest,
        AbortRequest,
        ControlRequest,
        ShutdownRequest,
        OutputBatch,
        TextBatch,
        ControlResult,
        SchedulerReady,
        SchedulerFailed,
    )
}
_encoder = msgspec.msgpack.Encoder()


class ProtocolError(RuntimeError):
    """A peer sent something that is not one of radixserve's messages."""


def encode(msg: object) -> list[bytes]:
    name = type(msg).__name__
    if name not in _TYPES:
        raise ProtocolError(f"{name} is not a radixserve message")
    return [name.encode(), _encoder.encode(msg)]


def decode(frames: list[bytes]) -> Any:
    if len(frames) != 2 or frames[0].decode(errors="replace") not in _TYPES:
        raise ProtocolError(f"unexpected frames {frames[:1]!r}")
    return msgspec.msgpack.decode(frames[1], type=_TYPES[frames[0].decode()])


class IpcDir:
    """A private directory for socket files, removed on close."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="radixserve-")
        os.chmod(self.path, 0o700)

    def address(self, name: str) -> str:
        return f"ipc://{os.path.join(self.path, name)}"

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class Channel:
    """One direction of a PUSH/PULL pipe. Not thread-safe: callers serialize sends themselves."""

    def __init__(
        self, context: zmq.Context[Any], address: str, *, send: bool, bind: bool, linger_ms: int = 0
    ):
        self.socket = context.socket(zmq.PUSH if send else zmq.PULL)
        # By default do not hang on close when the peer is gone; a last word (an error) may linger.
        self.socket.setsockopt(zmq.LINGER, linger_ms)
        if bind:
            self.socket.bind(address)
        else:
            self.socket.connect(address)

    def send(self, msg: object, timeout_ms: int | None = None) -> bool:
        """Sends msg; with a timeout, gives up (returning False) if no peer takes it in time."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLOUT):
            return False
        self.socket.send_multipart(encode(msg))
        return True

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """The next message, or None if none came within timeout_ms (0: don't wait)."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return decode(self.socket.recv_multipart())

    def close(self) -> None:
        self.socket.close()
