"""`radixserve serve --node-rank N` (N > 0): this machine's share of a multi-node model's ranks.

Node 0 runs the HTTP server, the detokenizer and rank 0; a worker node runs only its scheduler
ranks, which take every input from rank 0 over torch.distributed. It stops when they do: after
node 0 shuts them down, or when one fails (node 0 gone, a bad address, out of memory).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from typing import Any

import zmq

from radixserve.config.server_args import ServerArgs
from radixserve.models.source import resolve_model_source
from radixserve.models.tokenizer import load_tokenizer
from radixserve.protocol.ipc import PARENT_CHECK_MS, Channel, IpcDir
from radixserve.protocol.messages import SchedulerFailed
from radixserve.runtime.launch import POLL_MS, Child, rank_name, scheduler_command

logger = logging.getLogger("radixserve")


class WorkerNode:
    def __init__(self, args: ServerArgs):
        assert args.node_rank > 0 and args.dist_init_addr is not None
        source = resolve_model_source(args.model_path)
        args.model_path = str(source.path)
        tokenizer = load_tokenizer(
            resolve_model_source(args.tokenizer_path) if args.tokenizer_path else source
        )
        self.ipc = IpcDir()
        self.zmq: zmq.Context[Any] = zmq.Context()
        tokenizer_dir = os.path.join(self.ipc.path, "tokenizer")
        tokenizer.save_pretrained(tokenizer_dir)
        # The ranks' last words, if they fail, come here (on node 0 they go to the detokenizer).
        failures = self.ipc.address("failures")
        self._failures = Channel(self.zmq, failures, send=False, bind=True)
        child_args = {**args.to_dict(), "api_key": None}
        per_node = args.ranks_per_node
        self.children = []
        for local in range(per_node):
            rank = args.node_rank * per_node + local
            command = scheduler_command(
                child_args, tokenizer_dir, failures, str(os.getpid()), str(PARENT_CHECK_MS), 0, rank,
                args.dist_init_addr,
            )  # fmt: skip
            self.children.append(Child(rank_name(args, 0, rank), subprocess.Popen(command)))
        logger.info("node %d runs %s; waiting for node 0 at %s", args.node_rank,
                    ", ".join(c.name for c in self.children), args.dist_init_addr)  # fmt: skip

    def wait(self) -> int:
        """Until the ranks stop: 0 when all stopped cleanly, 1 when one failed (the others are
        stopped then too)."""
        while True:
            msg = self._failures.recv(POLL_MS)
            if isinstance(msg, SchedulerFailed):
                logger.error("%s", msg.error)
            codes = [child.process.poll() for child in self.children]
            failed = [c.exit_message() for c, code in zip(self.children, codes, strict=True) if code]
            if failed:
                logger.error("%s; stopping this node", failed[0])
                return 1
            if all(code == 0 for code in codes):
                logger.info("node 0 shut the model down; this node stops too")
                return 0

    def close(self) -> None:
        for child in self.children:
            if child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + 5
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        self._failures.close()
        self.zmq.term()
        self.ipc.close()


def serve_worker_node(args: ServerArgs) -> int:
    node = WorkerNode(args)
    try:
        return node.wait()
    finally:
        node.close()
