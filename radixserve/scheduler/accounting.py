"""What the scheduler reports of its KV and its parts, and its self-check when it goes idle.

A mixin of Scheduler (scheduler.py): it reads the state the scheduler builds; kept apart so that
scheduler.py holds the steps.
"""

from __future__ import annotations

from typing import Any

from radixserve.cache.radix_cache import KVLeakError, PrefixCache
from radixserve.cache.tiers import CacheTier
from radixserve.executor.base import Executor
from radixserve.scheduler.batch import KVContext
from radixserve.scheduler.disaggregation.decode import DecodeHandoffs
from radixserve.scheduler.disaggregation.prefill import PrefillHandoffs
from radixserve.scheduler.kv_events import KVEventPublisher
from radixserve.scheduler.pipeline import MicroBatchPipeline
from radixserve.scheduler.speculative.worker import Speculator
from radixserve.scheduler.state import token_usage


class SchedulerAccounting:
    kv: KVContext
    max_total_tokens: int
    executor: Executor
    speculator: Speculator | None
    tree_cache: PrefixCache
    cache_tier: CacheTier
    kv_events: KVEventPublisher | None
    pipeline: MicroBatchPipeline | None
    prefill_handoffs: PrefillHandoffs | None
    decode_handoffs: DecodeHandoffs | None
    # Set when a request arrives; the idle self-check runs once per idle spell.
    _idle_checked: bool

    def pipeline_stats(self) -> dict[str, Any]:
        return {"stages": 1} if self.pipeline is None else self.pipeline.stats()

    def disaggregation_stats(self) -> dict[str, Any]:
        handoffs = self.prefill_handoffs or self.decode_handoffs
        return {"mode": "null"} if handoffs is None else handoffs.stats()

    def token_usage(self) -> float:
        return token_usage(self.kv, self.max_total_tokens)

    def _check_idle(self) -> None:
        if self._idle_checked:
            return
        self.executor.idle()
        if self.speculator is not None:
            self.speculator.idle()
        self.check_kv_invariant()
        self._idle_checked = True

    def check_kv_invariant(self) -> None:
        """Raises KVLeakError unless every KV slot is free or evictable and every request slot is
        free, and the tier below keeps its own accounting."""
        self.tree_cache.check_invariant()
        problems = self.cache_tier.check_invariant()
        if problems:
            raise KVLeakError("; ".join(problems))

    @property
    def kv_events_pending(self) -> bool:
        """KV events recorded and not yet published: an idle scheduler steps once to send them."""
        return self.kv_events is not None and self.kv_events.recorder.pending
