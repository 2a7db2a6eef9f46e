"""The scheduler: decides, step by step, what the model runs next (event_loop.py drives it).

Each step: receive (requests that waited outside the queues join them) → pick the next batch (a
prefill of waiting requests if any can be admitted, else one decode step of the running batch) →
forward → process results (append tokens, finish requests, stream outputs) → end the step; with
nothing to run, idle. Features that act at these phases (grammars compiling, the cache tier, PD
handoffs, KV events, speculation, the profiler) are components the step walks (components.py).
It owns the request queues (state.py), the radix cache and the KV pools; choosing a prefill batch
is PrefillManager's job (prefill.py), a decode batch and retraction DecodeManager's (decode.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import ChunkCache, PrefixCache, RadixCache
from radixserve.config.kv_events_args import parse_kv_events_config
from radixserve.config.server_args import ServerArgs
from radixserve.distributed.parallel import SINGLE, ParallelContext
from radixserve.executor.base import (
    Embeddings,
    Executor,
    KVSlots,
    MemoryControl,
    MissingCapabilityError,
    PipelineStages,
)
from radixserve.protocol.messages import (
    AbortRequest,
    ControlRequest,
    FinishReason,
    GenerateRequest,
    ReqOutput,
    SchedulerInput,
    SchedulerOutput,
)
from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.scheduler.aborts import abort_requests, abort_targets
from radixserve.scheduler.accounting import SchedulerAccounting
from radixserve.scheduler.batch import KVContext
from radixserve.scheduler.cache_tier import build_cache_tier
from radixserve.scheduler.components import (
    GrammarArrivals,
    HandoffArrivals,
    KVEventsFlush,
    PrefillHandoffsClose,
    ProfilerHooks,
    SpeculatorHooks,
    StepComponent,
    TierLoads,
)
from radixserve.scheduler.control import handle_control
from radixserve.scheduler.decode import DecodeManager
from radixserve.scheduler.disaggregation.build import build_handoffs
from radixserve.scheduler.grammar import InvalidGrammarError, grammar_key
from radixserve.scheduler.grammar_queue import GrammarQueue
from radixserve.scheduler.images import image_support
from radixserve.scheduler.kv_events import KVEventPublisher
from radixserve.scheduler.logit_processors import ProcessorRegistry
from radixserve.scheduler.logprobs import record_input_logprobs
from radixserve.scheduler.lora import LoraManager
from radixserve.scheduler.next_tokens import pick_next_tokens, record_prompt_hidden_states
from radixserve.scheduler.outputs import Decided, OutputBuilder, OverlappedPublisher, overlap_enabled
from radixserve.scheduler.pipeline import MicroBatchPipeline
from radixserve.scheduler.policy import SchedulePolicy
from radixserve.scheduler.prefill import PrefillManager
from radixserve.scheduler.profiler import StepProfiler
from radixserve.scheduler.rank_sync import RankSync
from radixserve.scheduler.req_factory import ReqFactory
from radixserve.scheduler.request import Req
from radixserve.scheduler.speculative.build import build_speculator
from radixserve.scheduler.state import RequestQueues, ScheduledBatch, release_kv
from radixserve.scheduler.stats import SchedulerStats
from radixserve.scheduler.tokenizer_access import SchedulerTokenizer

logger = logging.getLogger("radixserve.scheduler")

DEFAULT_MAX_RUNNING_REQUESTS = 256
# With nothing to run but a component's own work (a grammar compiling, say), wake up this often to
# check messages.
IDLE_POLL_S = 0.01


class Scheduler(SchedulerAccounting):
    def __init__(
        self,
        args: ServerArgs,
        executor: Executor,
        tokenizer: Any = None,
        parallel: ParallelContext = SINGLE,
        draft: Executor | None = None,
        dp_rank: int = 0,
    ):
        """executor runs the model (executor/base.py); scheduler/process.py builds one for a real
        model (build_scheduler), tests a fake one. draft: the draft model of
        --speculative-algorithm STANDALONE, its KV pool as large as the executor's. dp_rank: this
        replica's place among --dp-size (its KV events' endpoint)."""
        # Loaded only when a stop string or grammar first needs it (scheduler/tokenizer_access.py).
        self.tokenizer = SchedulerTokenizer(tokenizer, args)
        self.executor = executor
        info = executor.info
        self.is_embedding = info.is_embedding
        self.rank_sync = RankSync(parallel)
        if info.config.is_encoder:
            # Bidirectional attention: a text runs whole, and its K/V cannot serve another text.
            args = dataclasses.replace(args, chunked_prefill_size=None, disable_radix_cache=True)
        self.args = args
        self.config = info.config
        self.context_len = info.context_len
        self.max_total_tokens = info.max_total_tokens
        max_running = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        device = info.device
        # One spare request slot: a request being prefilled in chunks is not counted as running.
        self.req_to_token_pool = ReqToTokenPool(max_running + 1, self.context_len + args.page_size, device)
        self.allocator = KVSlotAllocator(self.max_total_tokens, args.page_size, device)
        events = parse_kv_events_config(args.kv_events_config, ValueError)
        self.kv_events = (
            KVEventPublisher(events, args.page_size, "GPU" if device.type == "cuda" else "CPU", dp_rank)
            if events is not None and parallel.is_leader and not args.disable_radix_cache
            else None
        )
        # --speculative-algorithm: decode steps verify drafts when there are some, and move the
        # accepted drafts' K/V to where their tokens end up.
        self.speculator = build_speculator(
            args, executor, draft, self.req_to_token_pool.max_context_len, self.rank_sync.agree
        )
        if self.speculator is not None and not isinstance(executor, KVSlots):
            raise MissingCapabilityError(executor, KVSlots, "--speculative-algorithm")
        # The executor's capabilities the steps use, narrowed once (not per step).
        self.kv_slots = executor if isinstance(executor, KVSlots) else None
        self.memory = executor if isinstance(executor, MemoryControl) else None
        self.embedder = executor if isinstance(executor, Embeddings) else None
        if self.is_embedding and self.embedder is None:
            raise MissingCapabilityError(executor, Embeddings, "an embedding model")
        # --enable-hierarchical-cache: the tier below the device pool (cache/tiers.py). K/V it
        # loads back were written without a draft model, which must not take them as its own.
        self.cache_tier = build_cache_tier(
            args,
            executor,
            self.allocator,
            self.kv_events.recorder if self.kv_events else None,
            written=self.speculator.written if self.speculator is not None else None,
            rank_sync=self.rank_sync,
        )
        self.tree_cache: PrefixCache = (
            ChunkCache(self.req_to_token_pool, self.allocator, args.page_size)
            if args.disable_radix_cache
            else RadixCache(
                self.req_to_token_pool,
                self.allocator,
                args.page_size,
                tier=self.cache_tier,
                events=self.kv_events.recorder if self.kv_events else None,
            )
        )
        self.kv = KVContext(self.req_to_token_pool, self.allocator, self.tree_cache, device)
        # --disaggregation-mode: the prefill side hands prompts' K/V on, the decode side takes it.
        self.prefill_handoffs, self.decode_handoffs = build_handoffs(
            args, executor, self.kv, self.speculator.written if self.speculator is not None else None
        )
        self.logit_processors = ProcessorRegistry(args.enable_custom_logit_processor)
        # --enable-lora: each request's adapter, and the adapters in the executor's slots.
        self.lora = LoraManager(executor, args.max_loras_per_batch) if args.enable_lora else None
        # Vision-language models: the images' stand-in ids and their encoding (images.py).
        self.images, images_refused = image_support(
            executor, self.speculator is not None, args.disaggregation_mode != "null", info.pipeline_stages
        )
        self.requests = ReqFactory(info, self.logit_processors, self.lora, self.images, images_refused)

        self.stats = SchedulerStats()
        # When the event loop last took requests (None: no event loop), and whether it was idle.
        self.received_at: float | None = None
        self.received_idle = False
        self.queues = RequestQueues()
        # The two halves of choosing a batch (prefill.py, decode.py); they share the queues.
        self.decode = DecodeManager(args, self.kv, self.queues, self.stats, self.max_total_tokens)
        self.prefill = PrefillManager(
            args,
            self.kv,
            self.queues,
            self.decode,
            self.stats,
            max_running,
            self.max_total_tokens,
            self.lora,
            self.images,
        )
        self.policy: SchedulePolicy = self.prefill.policy
        # --pp-size > 1: micro-batches keep the pipeline's stages busy at once (pipeline.py).
        self.pipeline = self._pipeline(info.pipeline_stages)
        self.grammar_queue = GrammarQueue(
            args.grammar_backend,
            args.grammar_timeout,
            self.tokenizer.full,
            self.config.vocab_size,
            agree=self.rank_sync.agree,
        )
        self.reqs: dict[str, Req] = {}
        self.outputs = OutputBuilder()
        # --enable/--disable-overlap-schedule: publish a step's results during the next forward.
        # A pipeline overlaps its own way: the publishing runs between its ticks.
        overlap = overlap_enabled(args, device) and self.pipeline is None
        self.publisher = OverlappedPublisher() if overlap else None
        # The last step's results, decided but not yet published (overlap schedule only).
        self._unpublished: Decided | None = None

        # Test hook (/slow_down): sleep this long before every forward.
        self.forward_sleep_s = 0.0
        # When the forward step now running began (None between steps): what the watchdog checks.
        self.step_started: float | None = None
        self.profiler = StepProfiler()
        self._idle_checked = True
        self.idle_waiters: list[ControlRequest] = []
        self.components = self._components()

    def _components(self) -> list[StepComponent]:
        """The features that act at the step's phases, in the order the step calls them."""
        self.grammar_arrivals = GrammarArrivals(self.grammar_queue, self._enqueue, self._finish)
        components: list[StepComponent] = [self.grammar_arrivals, TierLoads(self.cache_tier)]
        if self.decode_handoffs is not None:
            start = self._start_handed_over
            components.append(
                HandoffArrivals(self.decode_handoffs, self.queues, self.stats, start, self._finish)
            )
        if self.prefill_handoffs is not None:
            components.append(PrefillHandoffsClose(self.prefill_handoffs))
        if self.kv_events is not None:
            components.append(KVEventsFlush(self.kv_events))
        if self.speculator is not None:
            components.append(SpeculatorHooks(self.speculator))
        components.append(ProfilerHooks(self.profiler))
        return components

    def _pipeline(self, stages: int) -> MicroBatchPipeline | None:
        if stages == 1:
            return None
        if self.speculator is not None or self.is_embedding or self.prefill_handoffs or self.decode_handoffs:
            raise ValueError("micro-batched pipeline parallelism does not run with speculative decoding, "
                             "embedding models or prefill/decode disaggregation")  # fmt: skip
        if not isinstance(self.executor, PipelineStages):
            raise MissingCapabilityError(self.executor, PipelineStages, "--pp-size")
        self.stages = self.executor
        return MicroBatchPipeline(stages, self.queues, self.kv, self.prefill, self.decode)

    # ------------------------------------------------------------------ requests in

    def handle(self, msg: SchedulerInput) -> list[SchedulerOutput]:
        # Published first: an abort must come after the last output, and a session's next turn
        # after its previous one's KV is in the cache.
        published: list[SchedulerOutput] = list(self._publish_unpublished())
        return published + self._handle(msg)

    def _handle(self, msg: SchedulerInput) -> list[SchedulerOutput]:
        if isinstance(msg, GenerateRequest):
            return list(self.add_request(msg))
        if isinstance(msg, AbortRequest):
            return list(self.abort(msg.rid, msg.abort_all, msg.exact, msg.message, msg.status_code))
        if isinstance(msg, ControlRequest):
            # Control messages find every request at rest: none in a pipeline stage's hands.
            drained: list[SchedulerOutput] = list(self._drain_pipeline())
            return drained + handle_control(self, msg)
        raise TypeError(f"unexpected scheduler message {type(msg).__name__}")

    def add_request(self, msg: GenerateRequest) -> list[ReqOutput]:
        if self.memory is not None and (released := self.memory.released):
            message = f"the {' and '.join(sorted(released))} memory is released; "
            message += "call /resume_memory_occupation first"
            finish = FinishReason("abort", message=message, status_code=503)
            return [ReqOutput(msg.rid, [], finish, len(msg.input_ids), 0, 0)]
        try:
            req = self.requests.build(msg, self.tree_cache.root, self.reqs)
            if self.received_at is not None:
                req.received_at, req.received_idle = self.received_at, self.received_idle
                if self.received_idle:
                    req.arrival_time = self.received_at
        except InvalidRequestError as exc:
            prompt_len = len(msg.input_ids) if msg.input_embeds is None else len(msg.input_embeds)
            return [self.outputs.error(msg.rid, prompt_len, str(exc))]
        params, prompt_len = req.sampling_params, len(req.origin_input_ids)
        if params.max_new_tokens == 0 and not req.needs_input_logprobs and not self.is_embedding:
            req.finished_reason = FinishReason("length")
            return [self.outputs.final(req)]
        if (error := self._admit_handoff(req, msg)) is not None:
            return [self.outputs.error(msg.rid, prompt_len, error, status_code=400)]
        self.reqs[req.rid] = req
        self._idle_checked = False
        if (key := grammar_key(params)) is not None:
            try:
                self.grammar_queue.add(req, key)
            except InvalidGrammarError as exc:
                del self.reqs[req.rid]
                return [self.outputs.error(msg.rid, prompt_len, str(exc))]
            return self.grammar_arrivals.receive()
        self._enqueue(req)
        return []

    def _enqueue(self, req: Req) -> None:
        """Into the waiting queue; on a decode server, to wait for its prompt's K/V instead."""
        if self.decode_handoffs is not None:
            self.decode_handoffs.wait_for_kv(req)
        else:
            self.queues.waiting.append(req)

    def _admit_handoff(self, req: Req, msg: GenerateRequest) -> str | None:
        """Under --disaggregation-mode: why the request cannot run on this half, or None."""
        req.bootstrap = msg.bootstrap
        if self.prefill_handoffs is not None:
            return self.prefill_handoffs.admit(req)
        if self.decode_handoffs is None:
            return None
        return self.decode_handoffs.refusal(req)

    def abort_all_and_flush(self) -> list[SchedulerOutput]:
        """After a weight change: requests in flight hold KV of the old weights, and so does the cache."""
        outputs: list[SchedulerOutput] = []
        for req in list(self.reqs.values()):
            outputs += self.abort(req.rid, exact=True)
        self.flush_cache()
        return outputs

    def abort(
        self,
        rid: str | None,
        abort_all: bool = False,
        exact: bool = False,
        message: str = "aborted by request",
        status_code: int | None = None,
    ) -> list[ReqOutput]:
        """Aborts every request whose rid starts with `rid`, only `rid` itself when exact, or all of
        them (aborts.py)."""
        # First every micro-batch in flight lands: nothing a pipeline stage still writes is freed.
        outputs = self._drain_pipeline()
        targets = abort_targets(self.reqs, rid, abort_all, exact)
        return outputs + abort_requests(self, targets, message, status_code)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[SchedulerOutput]:
        """One pass of the loop: receive → pick a batch → forward and process its results → end."""
        started, steps = time.perf_counter(), self.stats.forward_steps
        outputs: list[SchedulerOutput] = [out for c in self.components for out in c.receive()]
        pipeline = self.pipeline
        batch = self._next_batch() if pipeline is None else pipeline.next_batch()
        if pipeline is not None and (batch is not None or pipeline.in_flight):
            outputs += self._run_tick(pipeline, batch)
        elif batch is None:
            outputs += self._idle()
        elif self.is_embedding:
            outputs += self._run_embedding_batch(batch)
        else:
            outputs += self._run_batch(batch)
        return outputs + self._end_step(started, steps)

    def _idle(self) -> list[ReqOutput]:
        """Nothing to run. Only a component's own work may be left to wait for (a grammar compiling,
        a prefix loading from the tier below, K/V from a prefill server): sleep on it instead of
        spinning; else the idle self-check."""
        published = self._publish_unpublished()
        if not any(component.wait(IDLE_POLL_S) for component in self.components):
            self._check_idle()
        return published

    def _end_step(self, started: float, steps: int) -> list[SchedulerOutput]:
        for component in self.components:
            component.end_step()
        if self.stats.forward_steps > steps:
            self.stats.step_time_s += time.perf_counter() - started
        outputs: list[SchedulerOutput] = []
        if self.idle_waiters and self.is_idle:
            waiters, self.idle_waiters = self.idle_waiters, []
            for msg in waiters:
                outputs += handle_control(self, msg)
        return outputs

    def _run_batch(self, batch: ScheduledBatch) -> list[ReqOutput]:
        """A generation step: its forward, then its results decided and published (with the overlap
        schedule, the previous step's are published during this forward, and this one's next)."""
        self._before_forward(batch, batch.is_prefill)
        unpublished, self._unpublished = self._unpublished, None
        publishing = None
        if unpublished is not None and self.publisher is not None:
            publishing = self.publisher.start(lambda: self._publish(unpublished))
            self.stats.overlapped_steps += 1
        forward_started = time.perf_counter()
        decode_rows = len(batch.reqs) if not batch.is_prefill and batch.verify is None else None
        self.stats.decode_host_time.forward_started(forward_started, decode_rows)
        try:
            logits, hidden = self.executor.forward(batch.forward)
        finally:
            # Joined even when the forward fails: nothing may touch the cache while it runs.
            published = [] if publishing is None else publishing.result()
        forward_ended = time.perf_counter()
        self.stats.forward_time_s += forward_ended - forward_started
        self.stats.decode_host_time.forward_ended(forward_ended)
        self._after_forward(batch, batch.is_prefill)
        if batch.verify is not None:
            decided = self._decide_verified(batch, logits, hidden)
        else:
            decided = self._decide_sampled(batch, logits, hidden)
        seconds = time.perf_counter() - forward_started
        for component in self.components:
            component.after_results(batch, batch.is_prefill, seconds)
        if self.publisher is None:
            return published + self._publish(decided)
        self._unpublished = decided
        return published

    def _run_tick(self, pipeline: MicroBatchPipeline, batch: ScheduledBatch | None) -> list[ReqOutput]:
        """One tick of the pipeline: `batch` (None: none) enters the first stage, every stage runs
        its micro-batch, and the one the last stage ran lands."""
        is_prefill = batch is not None and batch.is_prefill
        self._before_forward(batch, is_prefill)
        forward_started = time.perf_counter()
        result = self.stages.forward_pipeline(pipeline.launch(batch))
        self.stats.forward_time_s += time.perf_counter() - forward_started
        self._after_forward(batch, is_prefill)
        landed = pipeline.land()
        if landed is None:
            return []
        assert result is not None, "the executor returned nothing for the micro-batch that landed"
        return self._publish(self._decide_sampled(landed, *result))

    def _before_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        self.stats.forward_steps += 1
        self.step_started = time.monotonic()
        if self.forward_sleep_s:
            time.sleep(self.forward_sleep_s)
        for component in self.components:
            component.before_forward(batch, is_prefill)

    def _after_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        self.step_started = None
        for component in self.components:
            component.after_forward(batch, is_prefill)

    def _start_handed_over(self, reqs: list[Req], first_tokens: list[int]) -> list[ReqOutput]:
        """Requests whose prompt's K/V a prefill server handed over: their first token, the prefill
        server's, is decided as a prefill's is, and they join the running batch."""
        decided = self._decide(reqs, [True] * len(reqs), True, [(token,) for token in first_tokens])
        return self._publish(decided)

    def _drain_pipeline(self) -> list[ReqOutput]:
        """Runs ticks without launching until no micro-batch is in flight."""
        outputs: list[ReqOutput] = []
        while self.pipeline is not None and self.pipeline.in_flight:
            outputs += self._run_tick(self.pipeline, None)
        return outputs

    def _decide_sampled(self, batch: ScheduledBatch, logits: torch.Tensor, hidden: torch.Tensor) -> Decided:
        """A prefill or decode step's results: one token for each request that samples."""
        sampling_reqs = [r for r, samples in zip(batch.reqs, batch.samples, strict=True) if samples]
        if batch.forward.logprob_rows is not None:
            record_input_logprobs(batch.reqs, logits[len(sampling_reqs) :])
            logits = logits[: len(sampling_reqs)]
        if batch.forward.hidden_rows is not None:
            record_prompt_hidden_states(batch.reqs, hidden[len(hidden) - len(batch.forward.hidden_rows) :])
        next_ids: list[int] = []
        if sampling_reqs:
            vocab, sample = self.config.vocab_size, self.executor.sample
            next_ids = pick_next_tokens(sampling_reqs, logits, hidden, vocab, sample, self._grammar_mask)
        return self._decide(batch.reqs, batch.samples, batch.is_prefill, [(token,) for token in next_ids])

    def _decide_verified(self, batch: ScheduledBatch, logits: torch.Tensor, hidden: torch.Tensor) -> Decided:
        """A verify step's results: each request's accepted drafts and one token of the model's."""
        plan, reqs, speculator = batch.verify, batch.reqs, self.speculator
        assert plan is not None and speculator is not None
        vocab, sample = self.config.vocab_size, self.executor.sample
        verified = speculator.verify(reqs, plan, logits, hidden, vocab, sample, self._grammar_mask)
        assert self.kv_slots is not None  # checked when the speculator was built
        speculator.commit(reqs, plan, verified, self.kv, self.kv_slots.move_kv)
        before = [len(r.output_ids) for r in reqs]
        decided = self._decide(batch.reqs, batch.samples, batch.is_prefill, [v.tokens for v in verified])
        kept = [len(r.output_ids) - n for r, n in zip(reqs, before, strict=True)]
        speculator.record(reqs, plan, verified, kept, logits, self.kv, self.stats)
        return decided

    def _run_embedding_batch(self, batch: ScheduledBatch) -> list[ReqOutput]:
        """Embedding requests finish with their prompt's pass (a chunk of a long one only fills KV)."""
        self._before_forward(batch, batch.is_prefill)
        assert self.embedder is not None  # checked at startup
        embeddings = self.embedder.embed(batch.forward).tolist()
        self._after_forward(batch, batch.is_prefill)
        done = [r for r in batch.reqs if r.kv_len == r.seq_len]
        for req, vector in zip(done, embeddings, strict=True):
            req.embedding = vector
        # An embedding samples no token.
        return self._publish(self._decide(batch.reqs, batch.samples, batch.is_prefill, [()] * len(done)))

    def _grammar_mask(self, reqs: list[Req], device: torch.device) -> torch.Tensor | None:
        if all(r.grammar is None for r in reqs):
            return None
        return self.grammar_queue.backend.bitmask([r.grammar for r in reqs], device)

    @property
    def is_idle(self) -> bool:
        queues = self.queues
        return not (
            queues.waiting
            or queues.running
            or queues.chunked_req
            or queues.in_flight
            or self._unpublished is not None
            or any(component.pending for component in self.components)
        )

    def _next_batch(self) -> ScheduledBatch | None:
        """A prefill whenever one can be admitted (it also carries the running requests along with
        --enable-mixed-chunk), else one decode step of the running requests."""
        prefill = self.prefill.next_batch()
        if prefill is not None:
            return prefill
        if self.queues.running:
            return self.decode.next_batch(self.speculator)
        return None

    # ------------------------------------------------------------------ results out

    def _decide(
        self, reqs: list[Req], samples: Sequence[bool], prefill: bool, next_ids: Sequence[Sequence[int]]
    ) -> Decided:
        """Everything about a step's results that the next batch depends on (outputs.py).
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
                self.tree_cache.cache_unfinished_req(req, req.cache_ids)
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
                self.tree_cache.cache_unfinished_req(req, req.cache_ids)
                queues.running.append(req)
            if interval == 1 or unsent_tokens(req) >= interval:
                publish((req, False))
        if finished:
            queues.running = [r for r in queues.running if id(r) not in finished]
        self.stats.generated_tokens += generated
        return decided

    def _append_token(self, req: Req, token: int) -> None:
        req.output_ids.append(token)
        if len(req.output_ids) == 1:
            self.stats.record_first_token(time.monotonic() - req.arrival_time)
        if req.grammar is not None:
            req.grammar.accept(token)
            if req.grammar.terminated:
                req.finished_reason = FinishReason("stop", matched=token)
        req.check_finished(self.context_len, self.tokenizer.decode if req.sampling_params.stop else None)

    def _publish(self, decided: Decided) -> list[ReqOutput]:
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

    def _publish_unpublished(self) -> list[ReqOutput]:
        unpublished, self._unpublished = self._unpublished, None
        return [] if unpublished is None else self._publish(unpublished)

    def _finish(self, req: Req) -> ReqOutput:
        self.reqs.pop(req.rid, None)
        return self.outputs.final(req)

    # ------------------------------------------------------------------ accounting

    def flush_cache(self) -> bool:
        if not self.is_idle:
            return False
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        if self.speculator is not None:
            self.speculator.reset()  # the n-gram index and the draft's K/V are cached text too
        return True

    def shutdown(self) -> None:
        """Stops the scheduler's threads and gives its parts' resources back."""
        for component in self.components:
            component.shutdown()
        if self.publisher is not None:
            self.publisher.shutdown()
        self.executor.close()
