"""The results phase of a step: a forward's logits turned into each request's new tokens (sampled,
or a verify step's accepted drafts and one token of the model's), then what those tokens do to
their requests, in the two halves the overlap schedule splits (outputs.py): deciding, which the
next batch depends on (each token appended, grammars advanced, stops checked, the running list
updated, prompt chunks cached), and publishing, which nothing in the next batch reads (finished
requests' KV released into the cache, their outputs built).

The scheduler (scheduler.py) runs the forward and hands its logits here; with the overlap schedule
it publishes one step's results while the next forward runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from radixserve.config.server_args import ServerArgs
from radixserve.executor.base import Executor, KVSlots
from radixserve.protocol.messages import NON_STREAM_OUTPUT_INTERVAL, FinishReason, ReqOutput
from radixserve.scheduler.batch import KVContext
from radixserve.scheduler.disaggregation.prefill import PrefillHandoffs
from radixserve.scheduler.grammar_queue import GrammarQueue
from radixserve.scheduler.logprobs import record_input_logprobs
from radixserve.scheduler.next_tokens import pick_next_tokens, record_prompt_hidden_states
from radixserve.scheduler.outputs import Decided, OutputBuilder
from radixserve.scheduler.request import Req
from radixserve.scheduler.speculative.worker import Speculator
from radixserve.scheduler.state import RequestQueues, ScheduledBatch, release_kv
from radixserve.scheduler.stats import SchedulerStats
from radixserve.scheduler.tokenizer_access import SchedulerTokenizer


class StepResults:
    def __init__(
        self,
        args: ServerArgs,
        executor: Executor,
        queues: RequestQueues,
        reqs: dict[str, Req],
        kv: KVContext,
        stats: SchedulerStats,
        outputs: OutputBuilder,
        tokenizer: SchedulerTokenizer,
        grammar_queue: GrammarQueue,
        speculator: Speculator | None,
        kv_slots: KVSlots | None,
        prefill_handoffs: PrefillHandoffs | None,
    ):
        """args: read on every step (/set_internal_state may change its stream_interval); reqs: the
        scheduler's requests in flight by rid, which a finished request leaves; kv_slots: the
        executor's, where a verify step moves accepted drafts' K/V (set with a speculator)."""
        self.args, self.executor = args, executor
        info = executor.info
        self.context_len, self.vocab_size = info.context_len, info.config.vocab_size
        self.queues, self.reqs, self.kv, self.tree_cache = queues, reqs, kv, kv.tree_cache
        self.stats, self.outputs, self.tokenizer = stats, outputs, tokenizer
        self.grammar_queue, self.speculator, self.kv_slots = grammar_queue, speculator, kv_slots
        self.prefill_handoffs = prefill_handoffs

    def sampled(self, batch: ScheduledBatch, logits: torch.Tensor, hidden: torch.Tensor) -> Decided:
        """A prefill or decode step's results: one token for each request that samples."""
        sampling_reqs = [r for r, samples in zip(batch.reqs, batch.samples, strict=True) if samples]
        if batch.forward.logprob_rows is not None:
            record_input_logprobs(batch.reqs, logits[len(sampling_reqs) :])
            logits = logits[: len(sampling_reqs)]
        if batch.forward.hidden_rows is not None:
            record_prompt_hidden_states(batch.reqs, hidden[len(hidden) - len(batch.forward.hidden_rows) :])
        next_ids: list[int] = []
        if sampling_reqs:
            vocab, sample = self.vocab_size, self.executor.sample
            next_ids = pick_next_tokens(sampling_reqs, logits, hidden, vocab, sample, self._grammar_mask)
        next_tokens = [(token,) for token in next_ids]
        return self.decide(batch.reqs, batch.samples, batch.is_prefill, next_tokens)

    def verified(self, batch: ScheduledBatch, logits: torch.Tensor, hidden: torch.Tensor) -> Decided:
        """A verify step's results: each request's accepted drafts and one token of the model's."""
        plan, reqs, speculator = batch.verify, batch.reqs, self.speculator
        assert plan is not None and speculator is not None
        vocab, sample = self.vocab_size, self.executor.sample
        verified = speculator.verify(reqs, plan, logits, hidden, vocab, sample, self._grammar_mask)
        assert self.kv_slots is not None  # checked when the speculator was built
        speculator.commit(reqs, plan, verified, self.kv, self.kv_slots.move_kv)
        before = [len(r.output_ids) for r in reqs]
        decided = self.decide(batch.reqs, batch.samples, batch.is_prefill, [v.tokens for v in verified])
        kept = [len(r.output_ids) - n for r, n in zip(reqs, before, strict=True)]
        speculator.record(reqs, plan, verified, kept, logits, self.kv, self.stats)
        return decided

    def handed_over(self, reqs: list[Req], first_tokens: list[int]) -> list[ReqOutput]:
        """Requests whose prompt's K/V a prefill server handed over: their first token, the prefill
        server's, is decided as a prefill's is, and they join the running batch."""
        decided = self.decide(reqs, [True] * len(reqs), True, [(token,) for token in first_tokens])
        return self.publish(decided)

    def _grammar_mask(self, reqs: list[Req], device: torch.device) -> torch.Tensor | None:
        if all(r.grammar is None for r in reqs):
            return None
        return self.grammar_queue.backend.bitmask([r.grammar for r in reqs], device)

    def decide(
        self, reqs: list[Req], samples: Sequence[bool], prefill: bool, next_ids: Sequence[Sequence[int]]
    ) -> Decided:
        """Everything about a step's results that the next batch depends on.
        samples: per request, whether it samples (not a chunk of its prompt); prefill: whether
        requests not yet running join the running list. next_ids: the new tokens of each request
        that samples, in order (several after a verify step; those after one that finishes the
        request are dropped)."""
        decided = Decided()
        queues = self.queues
        # Sets, not list scans, and finished_reason rather than the property: this runs for every
        # request on every step. Only a prefill adds to the running list (a decode needs no set).
        running = {id(r) for r in queues.running} if prefill else set()
        finished: set[int] = set()
        generated = 0
        # Every request that sampled has an unsent token, so with an interval of 1 all of them
        # publish: no need to ask the builder per request.
        interval = self.args.stream_interval
        unsent_tokens = self.outputs.unsent_tokens
        append_token, publish = self._append_token, decided.reqs.append
        sampled = iter(next_ids)
        for req, sampling in zip(reqs, samples, strict=True):
            if not sampling:
                # A chunk of a long prompt: publish the computed part so later requests can share it.
                self._cache_computed(req)
                continue
            tokens = next(sampled)
            if req.sampling_params.max_new_tokens == 0:
                # Prefilled only for its prompt logprobs (a scoring request): nothing to output.
                req.finished_reason = FinishReason("length")
            else:
                for token in tokens:
                    append_token(req, token)
                    generated += 1
                    if req.finished_reason is not None:
                        break
            if req.finished_reason is not None:
                if self.speculator is not None:
                    self.speculator.observe(req)  # its whole text, for later requests to draft from
                # Out of reach of aborts now; its KV is released when it is published.
                self.reqs.pop(req.rid, None)
                finished.add(id(req))
                publish((req, True))
                continue
            if prefill and id(req) not in running:
                self._cache_computed(req)
                queues.running.append(req)
            if req.stream:
                if interval == 1 or unsent_tokens(req) >= interval:
                    publish((req, False))
            elif unsent_tokens(req) >= NON_STREAM_OUTPUT_INTERVAL or len(req.output_ids) == 1:
                publish((req, False))
        if finished:
            queues.running = [r for r in queues.running if id(r) not in finished]
        self.stats.generated_tokens += generated
        return decided

    def _cache_computed(self, req: Req) -> None:
        """The tree takes the request's computed positions; first their window slots go back where
        the request's next token no longer sees them (cache/swa_pool.py), as the tree keeps what it
        takes."""
        self.kv.release_window([req])
        self.tree_cache.cache_unfinished_req(req, req.cache_ids)

    def _append_token(self, req: Req, token: int) -> None:
        req.output_ids.append(token)
        if len(req.output_ids) == 1:
            self.stats.record_first_token(time.monotonic() - req.arrival_time)
        if req.grammar is not None:
            req.grammar.accept(token)
            if req.grammar.terminated:
                req.finished_reason = FinishReason("stop", matched=token)
        req.check_finished(self.context_len, self.tokenizer.decode if req.sampling_params.stop else None)

    def publish(self, decided: Decided) -> list[ReqOutput]:
        """Releases finished requests' KV into the cache and builds the outputs (outputs.py)."""
        outputs: list[ReqOutput] = []
        output, progress = outputs.append, self.outputs.progress  # hoisted: once per request
        for req, finished in decided.reqs:
            if finished:
                if self.prefill_handoffs is not None:
                    self.prefill_handoffs.finished(req)  # copies its prompt's K/V out first
                release_kv(self.tree_cache, req)
                output(self.outputs.final(req))
            else:
                output(progress(req))
        return outputs

    def finish(self, req: Req) -> ReqOutput:
        """A request that ends outside a step's results (its grammar or its K/V handoff failed)."""
        self.reqs.pop(req.rid, None)
        return self.outputs.final(req)
