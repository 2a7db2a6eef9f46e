"""The prefill side of a step: which waiting requests (and which chunk of a long prompt) run next.

The queue order comes from SchedulePolicy and the budgets from PrefillAdder (policy.py); the
running requests' share of the KV pool comes from the decode side (decode.py). With
--enable-mixed-chunk the running requests ride along in the prefill batch as 1-token extends.
"""

from __future__ import annotations

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tiers import DeviceOnlyTier
from radixserve.config.server_args import ServerArgs
from radixserve.scheduler.batch import KVContext, build_extend_batch
from radixserve.scheduler.decode import DecodeManager
from radixserve.scheduler.images import ImageEncoder
from radixserve.scheduler.lora import LoraManager
from radixserve.scheduler.policy import (
    CLIP_MAX_NEW_TOKENS_ESTIMATE,
    AddResult,
    PrefillAdder,
    PriorityRule,
    SchedulePolicy,
)
from radixserve.scheduler.request import Req
from radixserve.scheduler.state import RequestQueues, ScheduledBatch, token_usage
from radixserve.scheduler.stats import SchedulerStats


class PrefillManager:
    def __init__(
        self,
        args: ServerArgs,
        kv: KVContext,
        queues: RequestQueues,
        decode: DecodeManager,
        stats: SchedulerStats,
        max_running: int,
        max_total_tokens: int,
        lora: LoraManager | None = None,
        images: ImageEncoder | None = None,
    ):
        # args is the scheduler's own object: /set_internal_state changes it in place.
        self.args = args
        self.kv = kv
        self.queues = queues
        self.decode = decode
        self.stats = stats
        # Running requests at most; a request prefilled in chunks is not counted until it runs.
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens
        priority = (
            PriorityRule(
                args.schedule_low_priority_values_first, args.priority_scheduling_preemption_threshold
            )
            if args.enable_priority_scheduling
            else None
        )
        self.policy = SchedulePolicy(args.schedule_policy, kv.tree_cache, args.random_seed, priority)
        # --enable-lora: a batch's adapters, with the running requests', must fit in its slots.
        self.lora = lora
        # Vision-language models: encodes the images a batch computes the tokens of.
        self.images = images

    def _not_loading(self, waiting: list[Req]) -> list[Req]:
        """The waiting requests that may be admitted now: a request whose prefix the cache tier
        below the device has more of waits (in the queue, not blocking the batch) until the tier
        has put that part into the tree. Each request is looked up once, when first seen here."""
        cache = self.kv.tree_cache
        if not isinstance(cache, RadixCache) or isinstance(cache.tier, DeviceOnlyTier):
            return waiting
        tier = cache.tier
        tier.install(cache)
        looked_up = False
        for req in waiting:
            if not req.tier_checked:
                req.tier_checked = True
                ids = req.prefix_match_ids()
                req.tier_load = tier.prefetch(ids, cache.match_prefix(ids).kv_indices)
                looked_up |= req.tier_load is not None
        if looked_up:
            tier.install(cache)  # a load from host memory alone is read already: into the tree now
        ready = []
        for req in waiting:
            if req.tier_load is not None:
                if not req.tier_load.done:
                    continue
                req.tier_load = None
            ready.append(req)
        return ready

    def _adapters_in_use(self) -> set[str]:
        """The LoRA adapters of the requests holding KV: running, in flight, being chunked."""
        queues = self.queues
        holders = queues.running + queues.in_flight + ([queues.chunked_req] if queues.chunked_req else [])
        return {r.lora_name for r in holders if r.lora_name is not None}

    def next_batch(self) -> ScheduledBatch | None:
        """The next prefill batch, or None when nothing waits or nothing more can be admitted."""
        queues, args = self.queues, self.args
        if not queues.waiting and queues.chunked_req is None:
            return None
        # Requests in a pipeline's micro-batches are running too, or about to be.
        running = len(queues.running) + len(queues.in_flight)
        if running >= self.max_running and queues.chunked_req is None:
            return None
        mix = bool(args.enable_mixed_chunk and queues.running)
        # Each running request that rides along computes one token of the batch's budget.
        decode_tokens = len(queues.running) if mix else 0
        chunk = args.chunked_prefill_size
        adder = PrefillAdder(
            tree_cache=self.kv.tree_cache,
            available_slots=self.kv.allocator.available_size(),
            running_reserved=self.decode.running_reserve() + decode_tokens,
            max_prefill_tokens=args.max_prefill_tokens - decode_tokens,
            chunk_budget=None if chunk is None else max(args.page_size, chunk - decode_tokens),
            page_size=args.page_size,
        )
        if queues.chunked_req is not None:
            adder.add_chunked_req(queues.chunked_req)
        has_chunked_req = queues.chunked_req is not None
        lora, adapters = self.lora, self._adapters_in_use()
        for req in self.policy.order(self._not_loading(queues.waiting)):
            if running + len(adder.can_run) >= self.max_running:
                break
            if lora is not None and not lora.fits(req, adapters):
                continue  # its adapter would be one too many for this batch: it waits its turn
            result = adder.add_one_req(req, has_chunked_req=has_chunked_req)
            if result is AddResult.NO_TOKEN and self._preempt_for(req, adder, decode_tokens):
                result = adder.add_one_req(req, has_chunked_req=has_chunked_req)
            if req.lora_name is not None and adder.can_run and adder.can_run[-1] is req:
                adapters.add(req.lora_name)
            if result is not AddResult.CONTINUE:
                break
        if not adder.can_run:
            return None
        if lora is not None:
            lora.bind(adder.can_run, adapters)

        _remove_admitted(queues.waiting, [r for r in adder.can_run if r is not queues.chunked_req])
        reqs = list(adder.can_run)
        if mix:
            for req in queues.running:
                req.extend_len = 1
            reqs += queues.running
        if lora is not None:
            # Each adapter's rows side by side: its deltas then read and add whole spans.
            reqs.sort(key=lambda r: -1 if r.lora_slot is None else r.lora_slot)
        if self.images is not None:
            self.images.prepare(reqs)
        forward = build_extend_batch(reqs, self.kv)
        if self.images is not None:
            self.images.release(reqs)
        in_progress = [r for r in adder.can_run if r.kv_len < r.seq_len]
        queues.chunked_req = in_progress[0] if in_progress else None
        self.stats.log_prefill(
            len(adder.can_run),
            adder.prefill_tokens,
            adder.cached_tokens,
            token_usage(self.kv, self.max_total_tokens),
            len(queues.running),
            len(queues.waiting),
        )
        return ScheduledBatch(reqs, forward, is_prefill=True)

    def _preempt_for(self, req: Req, adder: PrefillAdder, decode_tokens: int) -> bool:
        """--enable-priority-scheduling: when `req` does not fit, sends running requests it outranks
        back to the queue (a retraction: they resume exactly from what the cache keeps), the least
        ranked first, if together they free enough; then the budget is taken again. Whether any went."""
        rule = self.policy.priority
        if rule is None:
            return False
        shortfall = adder.kv_shortfall(req)
        chosen: list[Req] = []
        freed = 0.0
        ratio = self.decode.new_token_ratio
        for victim in rule.victims(req, self.queues.running):
            if freed >= shortfall:
                break
            chosen.append(victim)
            # Its own K/V goes to the cache as evictable, and its reserve is no longer held back.
            reserve = min(victim.remaining_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATE) * ratio
            freed += victim.kv_len - victim.cached_len + reserve
        if not chosen or freed < shortfall:
            return False  # preempting would not make room: nothing is sent back in vain
        self.decode.preempt(chosen, req)
        adder.available_slots = self.kv.allocator.available_size()
        adder.running_reserved = self.decode.running_reserve() + decode_tokens
        return True


def _remove_admitted(waiting: list[Req], admitted: list[Req]) -> None:
    """Takes the admitted requests out of the queue, in place. They are most often its head (in
    arrival order, the queue's own), which costs O(admitted) instead of a pass over a queue that
    may hold thousands."""
    head = len(admitted)
    if len(waiting) >= head and all(a is b for a, b in zip(waiting[:head], admitted, strict=True)):
        del waiting[:head]
        return
    taken = {id(r) for r in admitted}
    waiting[:] = [r for r in waiting if id(r) not in taken]
