"""What the scheduler's parts share between steps: where each request is, and the batch a step runs.

The scheduler (scheduler.py), the prefill side (prefill.py) and the decode side (decode.py) all move
requests between the same queues; keeping the queues in one object means no part holds a stale copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.cache.radix_cache import PrefixCache
from radixserve.forward.batch import ForwardBatch
from radixserve.scheduler.batch import KVContext
from radixserve.scheduler.request import Req
from radixserve.scheduler.speculative.worker import VerifyPlan


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    forward: ForwardBatch
    is_prefill: bool
    # A speculative verify step's drafts (forward.mode is VERIFY), else None.
    verify: VerifyPlan | None = None
    # Per request, whether this batch ends its input (so it samples) rather than computing a
    # chunk of its prompt: fixed when the batch is built, as a pipeline may build a request's
    # next chunk before this one's results are in (pipeline.py).
    samples: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        # Only a prefill has chunks; every request of a decode or verify step samples.
        if self.is_prefill:
            self.samples = [r.kv_len == r.seq_len for r in self.reqs]
        else:
            self.samples = [True] * len(self.reqs)


@dataclass
class RequestQueues:
    """The requests the scheduler holds outside the grammar queue; each is in at most one place."""

    # Not admitted yet, or sent back by a retraction: holds no KV of its own.
    waiting: list[Req] = field(default_factory=list)
    # Prefilled and decoding: each holds a request slot and the KV of everything it has.
    running: list[Req] = field(default_factory=list)
    # Being prefilled in chunks: holds KV for the chunks done, but is not running (it has nothing
    # to decode yet), so the request-slot pool keeps a spare slot for it.
    chunked_req: Req | None = None
    # In a micro-batch still going through the pipeline stages (--pp-size > 1, pipeline.py): out
    # of the places above until it lands, holding its KV, so no other batch takes it up meanwhile.
    in_flight: list[Req] = field(default_factory=list)


def release_kv(tree_cache: PrefixCache, req: Req) -> None:
    """Hands a request's KV to the cache (which keeps what it can share and frees the rest) and
    frees its request slot; a request that holds none is left alone."""
    if req.req_pool_idx is None:
        return
    tree_cache.cache_finished_req(req, req.cache_ids)


def token_usage(kv: KVContext, max_total_tokens: int) -> float:
    """The fraction of the KV pool that is neither free nor evictable."""
    return 1.0 - kv.available_with_eviction() / max_total_tokens
