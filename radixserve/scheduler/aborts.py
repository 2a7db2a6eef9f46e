"""Aborting requests wherever they are: waiting, compiling a grammar, waiting for a prefill
server's K/V, mid-chunk or running. Called between steps, when no forward is in flight."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cache.radix_cache import PrefixCache
from radixserve.protocol.messages import ReqOutput
from radixserve.scheduler.disaggregation.decode import DecodeHandoffs
from radixserve.scheduler.disaggregation.prefill import PrefillHandoffs
from radixserve.scheduler.grammar_queue import GrammarQueue
from radixserve.scheduler.outputs import OutputBuilder
from radixserve.scheduler.request import Req
from radixserve.scheduler.state import RequestQueues, release_kv
from radixserve.scheduler.stats import SchedulerStats


@dataclass(frozen=True)
class AbortParts:
    """What an abort changes: the scheduler's parts, built once by the scheduler (scheduler.py),
    so this module never needs the scheduler itself (which imports it)."""

    reqs: dict[str, Req]
    stats: SchedulerStats
    queues: RequestQueues
    tree_cache: PrefixCache
    grammar_queue: GrammarQueue
    outputs: OutputBuilder
    prefill_handoffs: PrefillHandoffs | None
    decode_handoffs: DecodeHandoffs | None


def abort_targets(reqs: dict[str, Req], rid: str | None, abort_all: bool, exact: bool) -> list[Req]:
    """Every request whose rid starts with `rid` (as SGLang does: the choices of one n > 1 request
    share their caller's prefix), only `rid` itself when exact, or all of them."""
    if abort_all:
        return list(reqs.values())
    if exact:
        return [reqs[rid]] if rid in reqs else []
    return [r for r in reqs.values() if rid and r.rid.startswith(rid)]


def abort_requests(
    parts: AbortParts, targets: list[Req], message: str, status_code: int | None
) -> list[ReqOutput]:
    """Finishes each target as aborted and gives back what it holds; its final output each."""
    queues, outputs = parts.queues, []
    for req in targets:
        req.abort(message, status_code)
        parts.stats.aborted_reqs += 1
        if parts.prefill_handoffs is not None:
            parts.prefill_handoffs.finished(req)  # the decode side stops waiting for it
        if req in queues.waiting:
            queues.waiting.remove(req)
        elif parts.decode_handoffs is not None and parts.decode_handoffs.abort(req):
            pass  # it waited for K/V, which it gave back
        elif not parts.grammar_queue.remove(req):  # one still compiling holds nothing yet
            # Between steps no forward is in flight, so the KV can be released right away.
            release_kv(parts.tree_cache, req)
            if req is queues.chunked_req:
                queues.chunked_req = None
            if req in queues.running:
                queues.running.remove(req)
        parts.reqs.pop(req.rid, None)
        outputs.append(parts.outputs.final(req))
    return outputs
