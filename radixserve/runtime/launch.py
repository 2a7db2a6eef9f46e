"""The engine's child processes: start them, wait until they are ready, watch them, stop them.

    engine ──GenerateRequest──▶ scheduler ──OutputBatch──▶ detokenizer ──TextBatch──▶ engine

With --dp-size N there are N scheduler processes (replicas), each with its own inbox, all sending
to the one detokenizer; the engine routes requests among them (runtime/dp_router.py). With --tp-size M
each replica is M scheduler processes, one per rank; only rank 0 has an inbox and talks to the
detokenizer, and it shares its inputs with the other ranks (scheduler/rank_sync.py). Ranks on
other machines (--nnodes) are started there by `radixserve serve --node-rank N` (WorkerNode).

The children are fresh interpreters (`python -m ...`), not multiprocessing forks: nothing is pickled,
and the caller's __main__ is never re-imported. They talk over ZMQ IPC sockets in a private 0700
directory, which also holds a copy of the tokenizer so that children load it in a fraction of a
second instead of re-reading (for a GGUF, re-converting) the checkpoint's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import zmq

from radixserve.config.parallel_args import parse_host_port
from radixserve.config.server_args import ServerArgs
from radixserve.protocol.ipc import PARENT_CHECK_MS, SLEEP_ON_IDLE_CHECK_MS, Channel, IpcDir
from radixserve.protocol.messages import SchedulerFailed, SchedulerInput, SchedulerReady, ShutdownRequest

logger = logging.getLogger("radixserve")

# How long the scheduler may take to load the model and report ready.
STARTUP_TIMEOUT_S = 600
# Receive timeout of the engine's reader: how often it checks that the children are alive.
POLL_MS = 200
# How long a clean shutdown may take before children are terminated.
SHUTDOWN_TIMEOUT_S = 20
# How long a dead child's traceback may still be on its way (its socket lingers 2 s).
FAILURE_GRACE_S = 3.0


class EngineDeadError(RuntimeError):
    """A child process stopped; the engine cannot serve more requests."""


def describe_exit(name: str, code: int) -> str:
    if code < 0:
        try:
            signame = signal.Signals(-code).name
        except ValueError:
            signame = f"signal {-code}"
        return f"the {name} process was killed by {signame}"
    return f"the {name} process exited with code {code}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def dist_init_addr(args: ServerArgs, replica: int) -> str | None:
    """Where the ranks of one replica (tensor and pipeline parallel) meet: --dist-init-addr (its
    port plus the replica's index), else a free local port."""
    if args.model_ranks == 1:
        return None
    if args.dist_init_addr is None:
        return f"127.0.0.1:{free_port()}"
    host, port = parse_host_port(args.dist_init_addr)
    return f"{host}:{port + replica}"


def scheduler_command(
    child_args: dict[str, Any],
    tokenizer_dir: str,
    outbox: str,
    parent: str,
    idle_wait: str,
    replica: int,
    rank: int,
    init_addr: str | None,
) -> list[str]:
    command = [
        sys.executable, "-m", "radixserve.scheduler.process",
        "--server-args-json", json.dumps(child_args), "--tokenizer-dir", tokenizer_dir,
        "--outbox", outbox, "--parent-pid", parent, "--idle-wait-ms", idle_wait,
        "--dp-rank", str(replica), "--rank", str(rank),
    ]  # fmt: skip
    return command + (["--dist-init-addr", init_addr] if init_addr else [])


def rank_name(args: ServerArgs, replica: int, rank: int) -> str:
    where = [f"dp rank {replica}"] if args.dp_size > 1 else []
    where += [f"pp rank {rank // args.tp_size}"] if args.pp_size > 1 else []
    where += [f"tp rank {rank % args.tp_size}"] if args.tp_size > 1 else []
    return "scheduler" + (f" ({', '.join(where)})" if where else "")


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]

    def exit_message(self) -> str | None:
        code = self.process.poll()
        return None if code is None else describe_exit(self.name, code)


class Runtime:
    """Owns the IPC directory, the sockets on the engine's side, and the child processes."""

    def __init__(self, args: ServerArgs):
        """Starts the children at once, before the tokenizer is written (provide_tokenizer): the
        schedulers load the model while this process loads the tokenizer (seconds each). The
        detokenizer waits for the tokenizer's directory; the schedulers read it only when a
        request first needs it, after the engine is ready."""
        self.ipc = IpcDir()
        self.zmq: zmq.Context[Any] = zmq.Context()
        self.tokenizer_dir = tokenizer_dir = os.path.join(self.ipc.path, "tokenizer")
        replicas = range(args.dp_size)
        to_schedulers = [self.ipc.address(f"scheduler-in-{i}") for i in replicas]
        init_addrs = [dist_init_addr(args, replica) for replica in replicas]
        to_detokenizer = self.ipc.address("detokenizer-in")
        to_engine = self.ipc.address("engine-in")
        self._to_schedulers = [Channel(self.zmq, address, send=True, bind=True) for address in to_schedulers]
        self._from_detokenizer = Channel(self.zmq, to_engine, send=False, bind=True)
        parent = str(os.getpid())
        # The API key stays in this process: children's command lines are visible to other users.
        child_args = {**args.to_dict(), "api_key": None}
        idle_wait = str(SLEEP_ON_IDLE_CHECK_MS if args.sleep_on_idle else PARENT_CHECK_MS)
        detokenizer_cmd = [
            sys.executable, "-m", "radixserve.runtime.detokenizer",
            "--tokenizer-dir", tokenizer_dir, "--inbox", to_detokenizer, "--outbox", to_engine,
            "--parent-pid", parent, "--log-level", args.log_level, "--idle-wait-ms", idle_wait,
            "--num-schedulers", str(args.dp_size),
        ]  # fmt: skip
        self.children = [Child("detokenizer", subprocess.Popen(detokenizer_cmd))]
        for replica, inbox, init_addr in zip(replicas, to_schedulers, init_addrs, strict=True):
            # This node's ranks: node 0 holds rank 0, which receives the replica's requests.
            for rank in range(args.ranks_per_node):
                command = scheduler_command(
                    child_args, tokenizer_dir, to_detokenizer, parent, idle_wait, replica, rank, init_addr
                )
                if rank == 0:
                    command += ["--inbox", inbox]
                self.children.append(Child(rank_name(args, replica, rank), subprocess.Popen(command)))
        self.closed = False

    def provide_tokenizer(self, tokenizer: Any) -> None:
        """Writes the tokenizer where the children read it: whole or not at all (a scratch
        directory renamed into place), since the detokenizer is waiting for it to appear."""
        scratch = f"{self.tokenizer_dir}.partial"
        tokenizer.save_pretrained(scratch)
        os.replace(scratch, self.tokenizer_dir)

    @property
    def num_replicas(self) -> int:
        return len(self._to_schedulers)

    @property
    def scheduler(self) -> subprocess.Popen[bytes]:
        return self.children[1].process

    def wait_ready(self) -> SchedulerReady:
        """Waits for every scheduler replica; returns the first one's report (they are alike)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        ready: list[SchedulerReady] = []
        while time.monotonic() < deadline:
            msg = self.recv(POLL_MS)
            if isinstance(msg, SchedulerReady):
                ready.append(msg)
                if len(ready) == self.num_replicas:
                    return ready[0]
            if isinstance(msg, SchedulerFailed):
                raise EngineDeadError(f"the scheduler failed to start:\n{msg.error}")
            if (dead := self.dead_child()) is not None:
                # A failing scheduler sends its traceback through the detokenizer and exits; the
                # exit can be seen before the message arrives, so wait a moment for its last word.
                if (error := self._failure_in_transit()) is not None:
                    raise EngineDeadError(f"the scheduler failed to start:\n{error}")
                raise EngineDeadError(f"{dead} during startup")
        raise EngineDeadError(f"the scheduler did not become ready within {STARTUP_TIMEOUT_S}s")

    def _failure_in_transit(self) -> str | None:
        deadline = time.monotonic() + FAILURE_GRACE_S
        while time.monotonic() < deadline:
            if isinstance(msg := self.recv(POLL_MS), SchedulerFailed):
                return msg.error
        return None

    def dead_child(self) -> str | None:
        """Why a child has stopped, or None while all run. A child killed by a signal comes first:
        when one rank is killed, its peers fail on their next collective and exit too, and the
        kill is the cause."""
        codes = [(child, child.process.poll()) for child in self.children]
        dead = sorted(((c, code) for c, code in codes if code is not None), key=lambda item: item[1] >= 0)
        return None if not dead else describe_exit(dead[0][0].name, dead[0][1])

    def recv(self, timeout_ms: int) -> Any | None:
        return self._from_detokenizer.recv(timeout_ms)

    def send(self, msg: SchedulerInput, replica: int = 0) -> None:
        """Not thread-safe; the engine serializes sends. A PUSH socket blocks while its peer is
        away, so wait in slices and give up if the scheduler died."""
        while not self._to_schedulers[replica].send(msg, timeout_ms=POLL_MS):
            if (dead := self.dead_child()) is not None:
                raise EngineDeadError(dead)

    def broadcast(self, msg: SchedulerInput) -> None:
        for replica in range(self.num_replicas):
            self.send(msg, replica)

    def shutdown(self) -> None:
        """Asks the scheduler to stop; it tells the detokenizer, which tells us. Then cleans up."""
        if self.closed:
            return
        if self.dead_child() is not None:
            # The request goes through the schedulers to the detokenizer: with a child dead it
            # cannot reach the rest, so waiting for them would only run out the timeout.
            self.kill()
            return
        with contextlib.suppress(EngineDeadError):
            self.broadcast(ShutdownRequest())
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("the %s process did not stop in time; terminating it", child.name)
        self.kill()

    def kill(self) -> None:
        """Stops the children now and removes every socket file. Safe to call more than once."""
        self.stop_children()
        if not self.closed:
            self.closed = True
            for channel in self._to_schedulers:
                channel.close()
            self._from_detokenizer.close()
            self.zmq.term()
            self.ipc.close()

    def stop_children(self) -> None:
        """Terminates the children and removes the socket files, touching no socket: safe from
        any thread, for a process about to exit."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.terminate()
        for child in self.children:
            try:
                child.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        self.ipc.close()
