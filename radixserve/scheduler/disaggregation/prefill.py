"""--disaggregation-mode prefill: prompts run here to their first token, then move on.

A request is prefilled as on any server (radix cache, chunks, tiers), sampled once, and finished.
Before its KV goes back to the cache, its prompt's K/V and first token are copied out and queued
for the decode server that claims its bootstrap room (distributed/kv_transfer.py). The copy is
taken on the scheduler's side, so the slots are free again at once and the cache keeps the prompt
for later requests that share it; the transfer thread sends it when the room is claimed.
"""

from __future__ import annotations

import dataclasses

from radixserve.cache.pools import ReqToTokenPool
from radixserve.cache.storage_tier import KVAccess
from radixserve.config.disaggregation_args import missing_bootstrap
from radixserve.distributed.kv_transfer import KVHandoff, PrefillTransfer
from radixserve.scheduler.request import Req


class PrefillHandoffs:
    def __init__(self, transfer: PrefillTransfer, kv_access: KVAccess, req_to_token_pool: ReqToTokenPool):
        self.transfer = transfer
        self.kv_access = kv_access
        self.req_to_token_pool = req_to_token_pool

    def admit(self, req: Req) -> str | None:
        """Why the request cannot run here, or None; it then samples one token."""
        if req.bootstrap is None:
            return missing_bootstrap("prefill")
        params = req.sampling_params
        params.max_new_tokens = min(params.max_new_tokens, 1)
        return None

    def finished(self, req: Req) -> None:
        """Called for a finished request while it still holds its KV: queue its handoff."""
        assert req.bootstrap is not None
        room = req.bootstrap.room
        reason = req.finished_reason
        if (reason is not None and reason.type == "abort") or not req.output_ids:
            if req.sampling_params.max_new_tokens == 0:
                return  # a scoring request: the decode server finishes it without K/V
            message = "the prefill server ended the request" + (f": {reason.message}" if reason else "")
            self.transfer.send(KVHandoff(room, None, message=message))
            return
        assert req.req_pool_idx is not None
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.origin_input_ids)]
        kv = self.kv_access.read_kv(slots)
        logprobs = None
        if req.logprobs is not None:
            logprobs = dataclasses.asdict(req.logprobs.since(0))
            logprobs = {key: value[:1] for key, value in logprobs.items()}
        self.transfer.send(KVHandoff(room, kv, req.output_ids[0], logprobs))

    def stats(self) -> dict[str, object]:
        return {"mode": "prefill", **self.transfer.stats()}

    def close(self) -> None:
        self.transfer.close()
