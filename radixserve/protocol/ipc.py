"""Typed messages over ZMQ IPC sockets: msgpack via msgspec, never pickle.

Each message travels as two frames: its type name and its msgpack body. The sockets live in a
private temporary directory (mode 0700), so only this user's processes on this machine reach them.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import msgspec
import zmq

from radixserve.protocol.messages import (
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
        if timeout_ms is None:
            self.socket.send_multipart(encode(msg))
            return True
        if not self.socket.poll(timeout_ms, zmq.POLLOUT):
            return False
        try:
            # Not blocking: a peer that dies between the poll and the send would otherwise leave
            # this send waiting forever (seen when a test killed the scheduler).
            self.socket.send_multipart(encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """The next message, or None if none came within timeout_ms (0: don't wait)."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return decode(self.socket.recv_multipart())

    def close(self) -> None:
        self.socket.close()


# How often an idle child wakes up to notice that its parent process has gone away; under
# --sleep-on-idle, less often (an orphan then lingers up to that long).
PARENT_CHECK_MS = 500
SLEEP_ON_IDLE_CHECK_MS = 5000


@dataclass
class ChildArgs:
    """What every child process is started with (see runtime/launch.py)."""

    inbox: str | None  # None for a tensor-parallel rank > 0: its inputs come from rank 0
    outbox: str
    parent_pid: int
    tokenizer_dir: str
    ns: argparse.Namespace
    # How long an idle child blocks on its inbox between parent checks.
    idle_wait_ms: int = PARENT_CHECK_MS


def parse_child_args(description: str, add_args: Callable[[argparse.ArgumentParser], object]) -> ChildArgs:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--inbox", default=None)
    parser.add_argument("--outbox", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--tokenizer-dir", required=True)
    parser.add_argument("--idle-wait-ms", type=int, default=PARENT_CHECK_MS)
    add_args(parser)
    ns = parser.parse_args()
    return ChildArgs(ns.inbox, ns.outbox, ns.parent_pid, ns.tokenizer_dir, ns, ns.idle_wait_ms)


@contextmanager
def child_channels(
    name: str, inbox_address: str | None, outbox_address: str, *, bind_inbox: bool
) -> Iterator[tuple[Channel | None, Channel]]:
    """A child's two sockets. An error that ends the child is sent on as its last word
    (SchedulerFailed with the traceback) before it propagates."""
    # Ctrl-C reaches the whole process group; the parent decides when children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context: zmq.Context[Any] = zmq.Context()
    inbox = None if inbox_address is None else Channel(context, inbox_address, send=False, bind=bind_inbox)
    outbox = Channel(context, outbox_address, send=True, bind=False, linger_ms=2000)
    try:
        yield inbox, outbox
    except BaseException as exc:
        if not isinstance(exc, SystemExit):
            outbox.send(SchedulerFailed(f"{name}: " + "".join(traceback.format_exception(exc))))
        raise
    finally:
        if inbox is not None:
            inbox.close()
        outbox.close()
        context.term()


def exit_after_clean_stop(code: int = 0) -> NoReturn:
    """Ends a process whose sockets, files and threads its own code has already closed, without
    the interpreter's teardown. Finalizing torch's modules frees nothing the OS would not, yet
    every engine stop (and every test's) would wait for it in each child. Logs and stdio are
    flushed first, so no last line is lost."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
