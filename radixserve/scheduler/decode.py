"""The decode side of a step: one decode batch of every running request, the retraction that makes
room for it when the KV pool runs short, and new_token_ratio, the guess of how much of their
remaining budget running requests will still use, which the prefill side reserves for them.
"""

from __future__ import annotations

import logging

from radixserve.config.server_args import ServerArgs
from radixserve.scheduler.batch import KVContext, KVExhaustedError, build_decode_batch, build_verify_batch
from radixserve.scheduler.policy import CLIP_MAX_NEW_TOKENS_ESTIMATE
from radixserve.scheduler.request import Req
from radixserve.scheduler.speculative.worker import Speculator
from radixserve.scheduler.state import RequestQueues, ScheduledBatch, release_kv, token_usage
from radixserve.scheduler.stats import SchedulerStats

logger = logging.getLogger("radixserve.scheduler")

# new_token_ratio: the fraction of a running request's remaining max_new_tokens the prefill budget
# reserves for it. It starts cautious, decays while decoding goes well, and jumps on retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
# After a retraction, keep this many decode steps of headroom so the next step does not retract again.
RETRACT_HEADROOM_STEPS = 20
# The least a retraction raises new_token_ratio by, so that admission backs off even when the
# running requests' own progress suggests a lower ratio.
RETRACT_RATIO_STEP = 0.1


class DecodeManager:
    def __init__(
        self,
        args: ServerArgs,
        kv: KVContext,
        queues: RequestQueues,
        stats: SchedulerStats,
        max_total_tokens: int,
    ):
        # args is the scheduler's own object: /set_internal_state changes it in place.
        self.args = args
        self.kv = kv
        self.queues = queues
        self.stats = stats
        self.max_total_tokens = max_total_tokens
        self.init_new_token_ratio = 0.0
        self.min_new_token_ratio = 0.0
        self.new_token_ratio_decay = 0.0
        self.new_token_ratio = 0.0
        self.reset_new_token_ratio()

    def reset_new_token_ratio(self) -> None:
        conservativeness = self.args.schedule_conservativeness
        self.init_new_token_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * conservativeness)
        self.min_new_token_ratio = self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio_decay = (
            self.init_new_token_ratio - self.min_new_token_ratio
        ) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio

    def running_reserve(self) -> float:
        """The KV slots the running requests are expected to need still, which admission leaves them."""
        # Requests in a pipeline's micro-batches are running too.
        reqs = self.queues.running + self.queues.in_flight
        expected = sum(min(r.remaining_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATE) for r in reqs)
        return expected * self.new_token_ratio

    def next_batch(self, speculator: Speculator | None = None, limit: int | None = None) -> ScheduledBatch:
        """One decode step of every running request (there must be one), or of the first `limit`
        (a pipeline's micro-batch): a verify step of their drafts when the speculator has some."""
        queues = self.queues
        if self.kv.available_with_eviction() < self.kv.slots_needed_for_decode(queues.running[:limit]):
            self.retract()
        else:
            self.new_token_ratio = max(
                self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio
            )
        reqs = queues.running[:limit]
        plan = None if speculator is None else speculator.plan(reqs, self.kv)
        if plan is None:
            forward = build_decode_batch(reqs, self.kv)
        else:
            forward = build_verify_batch(reqs, plan.trees, self.kv, plan.out_cache_loc)
        self.stats.record_decode(len(reqs))
        if self.stats.decode_steps % self.args.decode_log_interval == 0:
            used = self.max_total_tokens - self.kv.available_with_eviction()
            usage = token_usage(self.kv, self.max_total_tokens)
            self.stats.log_decode(len(reqs), used, usage, len(queues.waiting))
        return ScheduledBatch(reqs, forward, is_prefill=False, verify=plan)

    def retract(self) -> None:
        """Free KV for the decode step by sending requests back to the queue, fewest outputs first."""
        queues, kv = self.queues, self.kv
        # Most progressed first, so that popping from the end retracts the cheapest to redo.
        keep = sorted(
            queues.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True
        )
        retracted: list[Req] = []
        while len(keep) > 1 and kv.available_with_eviction() < (
            kv.slots_needed_for_decode(keep) + RETRACT_HEADROOM_STEPS * len(keep)
        ):
            victim = keep.pop()
            self._send_back(victim, retracted)
        if queues.chunked_req is not None and kv.available_with_eviction() < kv.slots_needed_for_decode(keep):
            # The half-prefilled request goes too before a running one is left without room.
            self._send_back(queues.chunked_req, retracted)
            queues.chunked_req = None
        if kv.available_with_eviction() < kv.slots_needed_for_decode(keep):
            raise KVExhaustedError("a single running request does not fit in the KV cache; this is a bug")

        kept = {id(r) for r in keep}
        queues.running = [r for r in queues.running if id(r) in kept]
        queues.waiting.extend(retracted)
        self.stats.retracted_reqs += len(retracted)
        decoded = sum(len(r.output_ids) for r in queues.running)
        budget = sum(r.sampling_params.max_new_tokens for r in queues.running)
        estimate = (decoded + RETRACT_HEADROOM_STEPS * len(queues.running)) / max(budget, 1)
        old = self.new_token_ratio
        self.new_token_ratio = min(1.0, max(estimate, old + RETRACT_RATIO_STEP))
        logger.info(
            "KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
            len(retracted),
            old,
            self.new_token_ratio,
        )

    def preempt(self, victims: list[Req], by: Req) -> None:
        """Sends running requests back to the queue for a waiting request that outranks them
        (--enable-priority-scheduling), as a retraction does."""
        sent_back: list[Req] = []
        for victim in victims:
            self._send_back(victim, sent_back)
        gone = {id(r) for r in victims}
        self.queues.running = [r for r in self.queues.running if id(r) not in gone]
        self.queues.waiting.extend(sent_back)
        self.stats.retracted_reqs += len(sent_back)
        logger.info(
            "Preempted %d running request(s) for request %s (priority %d)",
            len(sent_back),
            by.rid,
            by.priority,
        )

    def _send_back(self, victim: Req, retracted: list[Req]) -> None:
        release_kv(self.kv.tree_cache, victim)
        victim.retractions += 1
        victim.tier_checked = False  # back in the queue: the tier below may hold what it computed
        retracted.append(victim)
