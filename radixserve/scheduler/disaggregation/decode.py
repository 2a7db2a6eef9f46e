"""--disaggregation-mode decode: requests start here from K/V a prefill server computed.

A new request waits in `awaiting` (it is not in the scheduler's queues):
1. **Reserve:** once the pool has room for its prompt (and a page for each running request's next
   token), it takes a request slot and KV slots for the prompt, then claims its bootstrap room on
   the prefill server. Claiming only with room reserved is the flow control: the prefill server
   sends nothing a decode server could not take.
2. **Receive:** the transfer thread delivers the prompt's K/V and first token. They are written into
   the reserved slots, and the request joins the running batch as if it had prefilled here.
3. **Give up:** an abort, a prefill-side failure or --disaggregation-timeout frees the slots (they
   never reach the cache: their K/V never came) and tells the prefill server to drop the room.

Everything else is the ordinary scheduler: a request retracted later is prefilled again here, from
its prompt and output, as on any server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.cache.storage_tier import KVAccess
from radixserve.config.disaggregation_args import missing_bootstrap
from radixserve.distributed.kv_transfer import DecodeTransfer, KVHandoff
from radixserve.protocol.messages import TokenLogprobs
from radixserve.scheduler.batch import KVContext, release_unfilled_prompt_kv, reserve_prompt_kv
from radixserve.scheduler.request import Req

# HTTP statuses of a request the decode server gives up: the prefill side failed (bad gateway),
# or it never sent the K/V (gateway timeout).
PREFILL_FAILED_STATUS = 502
PREFILL_TIMEOUT_STATUS = 504


@dataclass
class _Awaiting:
    req: Req
    deadline: float
    claimed: bool = False


@dataclass
class Received:
    """A request whose K/V arrived (first_token set) or that failed (error set)."""

    req: Req
    first_token: int = -1
    error: str | None = None
    status_code: int | None = None


class DecodeHandoffs:
    def __init__(
        self,
        transfer: DecodeTransfer,
        kv: KVContext,
        kv_access: KVAccess,
        timeout_s: float,
        written: Callable[[torch.Tensor], None] | None = None,
    ):
        """written: told which slots received K/V from elsewhere (a draft model catches up)."""
        self.transfer = transfer
        self.kv = kv
        self.kv_access = kv_access
        self.timeout_s = timeout_s
        self.written = written
        self.awaiting: dict[int, _Awaiting] = {}

    def __len__(self) -> int:
        return len(self.awaiting)

    def refusal(self, req: Req) -> str | None:
        """Why the request cannot be served here, or None (then wait_for_kv, once its grammar, if
        any, is compiled: the first token the prefill server sampled advances it)."""
        info = req.bootstrap
        if info is None:
            return missing_bootstrap("decode")
        if info.room in self.awaiting:
            return f"bootstrap_room {info.room} is already in use on this decode server"
        if req.input_embeds is not None or req.input_logprobs is not None or req.return_hidden_states:
            return "prompt vectors, prompt logprobs and hidden states do not cross a prefill/decode handoff"
        return None

    def wait_for_kv(self, req: Req) -> None:
        assert req.bootstrap is not None
        self.awaiting[req.bootstrap.room] = _Awaiting(req, time.monotonic() + self.timeout_s)

    def reserve_and_claim(self, running: list[Req]) -> None:
        """Reserves KV for waiting requests in arrival order while the pool has room beyond a page
        for each running request's next token, and claims their rooms."""
        headroom = self.kv.slots_needed_for_decode(running)
        for entry in self.awaiting.values():
            if entry.claimed:
                continue
            if not reserve_prompt_kv(entry.req, self.kv, headroom):
                return  # first come, first served: no later request jumps the queue
            info = entry.req.bootstrap
            assert info is not None
            self.transfer.expect(info.room, info.host, info.port)
            entry.claimed = True

    def receive(self) -> list[Received]:
        """K/V that arrived (written into the reserved slots), failures, and timeouts."""
        results = []
        for handoff in self.transfer.poll():
            entry = self.awaiting.pop(handoff.room, None)
            if entry is None:
                continue  # given up already (the transfer drops most of these itself)
            results.append(self._install(entry.req, handoff))
        now = time.monotonic()
        for room, entry in list(self.awaiting.items()):
            if now > entry.deadline:
                del self.awaiting[room]
                self._give_up(entry)
                message = f"the prefill server sent no K/V within {self.timeout_s:g} s"
                results.append(Received(entry.req, error=message, status_code=PREFILL_TIMEOUT_STATUS))
        return results

    def _install(self, req: Req, handoff: KVHandoff) -> Received:
        length = len(req.origin_input_ids)
        kv = handoff.kv
        error = handoff.message if kv is None else None
        if kv is not None and kv.shape[2] != length:
            error = (
                f"the prefill server computed {kv.shape[2]} prompt tokens, this server tokenized "
                f"{length}: both must run the same model, tokenizer and chat template"
            )
        elif kv is not None and req.logprobs is not None and handoff.logprobs is None:
            error = "the prefill server sent no logprobs for the first token"
        if kv is None or error is not None:
            release_unfilled_prompt_kv(req, self.kv)
            return Received(req, error=error, status_code=PREFILL_FAILED_STATUS)
        assert req.req_pool_idx is not None
        slots = self.kv.req_to_token_pool.req_to_token[req.req_pool_idx, :length]
        self.kv_access.write_kv(slots, kv)
        if self.written is not None:
            self.written(slots)
        req.kv_len = req.computed_len = length
        if req.logprobs is not None and handoff.logprobs is not None:
            req.logprobs.extend(TokenLogprobs(**handoff.logprobs))
        return Received(req, first_token=handoff.first_token)

    def abort(self, req: Req) -> bool:
        """Gives up a request still waiting for K/V; False when it is not waiting here."""
        info = req.bootstrap
        if (
            info is None
            or self.awaiting.get(info.room, None) is None
            or self.awaiting[info.room].req is not req
        ):
            return False
        self._give_up(self.awaiting.pop(info.room))
        return True

    def _give_up(self, entry: _Awaiting) -> None:
        info = entry.req.bootstrap
        assert info is not None
        release_unfilled_prompt_kv(entry.req, self.kv)
        self.transfer.forget(info.room, info.host, info.port)

    def wait(self, timeout_s: float) -> None:
        self.transfer.wait(timeout_s)

    def stats(self) -> dict[str, object]:
        return {"mode": "decode", "awaiting_kv": len(self.awaiting), **self.transfer.stats()}

    def close(self) -> None:
        self.transfer.close()
