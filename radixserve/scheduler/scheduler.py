"""The scheduler: decides, step by step, what the model runs next (event_loop.py drives it).

Each step: receive (requests that waited outside the queues join them) → pick the next batch (a
prefill of waiting requests if any can be admitted, else one decode step of the running batch) →
forward → process results (append tokens, finish requests, stream outputs) → end the step; with
nothing to run, idle. Features that act at these phases (grammars compiling, the cache tier, PD
handoffs, KV events, speculation, the profiler) are components the step walks (components.py).
It owns the request queues (state.py), the radix cache and the KV pools; choosing a prefill batch
is PrefillManager's job (prefill.py), a decode batch and retraction DecodeManager's (decode.py),
what the new tokens do to their requests StepResults' (results.py). Control commands (control.py),
aborts (aborts.py) and the KV accounting (accounting.py) get the parts they use, built here once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import ChunkCache, PrefixCache, RadixCache
from radixserve.cache.swa_pool import WindowSlotAllocator
from radixserve.config.kv_events_args import parse_kv_events_config
from radixserve.config.server_args import ServerArgs, chunked_prefill_tokens
from radixserve.distributed.parallel import SINGLE, ParallelContext
from radixserve.executor.base import (
    Embeddings,
    Executor,
    ExpertRecording,
    KVSlots,
    MemoryControl,
    MissingCapabilityError,
    PipelineStages,
    WeightControl,
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
from radixserve.scheduler.aborts import AbortParts, abort_requests, abort_targets
from radixserve.scheduler.accounting import IdleSelfCheck, KVAccounting
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
from radixserve.scheduler.control import ControlParts, Controls, ForwardDelay
from radixserve.scheduler.decode import DecodeManager
from radixserve.scheduler.disaggregation.build import build_handoffs
from radixserve.scheduler.grammar import InvalidGrammarError, grammar_key
from radixserve.scheduler.grammar_queue import GrammarQueue
from radixserve.scheduler.images import image_support
from radixserve.scheduler.kv_events import KVEventPublisher
from radixserve.scheduler.logit_processors import ProcessorRegistry
from radixserve.scheduler.lora import LoraManager
from radixserve.scheduler.outputs import Decided, OutputBuilder, OverlappedPublisher, overlap_enabled
from radixserve.scheduler.pipeline import MicroBatchPipeline
from radixserve.scheduler.policy import SchedulePolicy
from radixserve.scheduler.prefill import PrefillManager
from radixserve.scheduler.profiler import StepProfiler
from radixserve.scheduler.rank_sync import RankSync
from radixserve.scheduler.req_factory import ReqFactory
from radixserve.scheduler.request import Req
from radixserve.scheduler.results import StepResults
from radixserve.scheduler.speculative.build import build_speculator
from radixserve.scheduler.state import RequestQueues, ScheduledBatch
from radixserve.scheduler.stats import SchedulerStats
from radixserve.scheduler.tokenizer_access import SchedulerTokenizer

logger = logging.getLogger("radixserve.scheduler")

DEFAULT_MAX_RUNNING_REQUESTS = 256
# With nothing to run but a component's own work (a grammar compiling, say), wake up this often to
# check messages.
IDLE_POLL_S = 0.01


class Scheduler:
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
        # From here on args hold the chunk size resolved for the device: a size, or None when off.
        chunk = chunked_prefill_tokens(args.chunked_prefill_size, info.device.type)
        args = dataclasses.replace(args, chunked_prefill_size=chunk)
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
        # Sliding-window layers with window slots of their own (cache/swa_pool.py) where the
        # executor holds them so.
        self.allocator = (
            KVSlotAllocator(self.max_total_tokens, args.page_size, device)
            if info.window is None
            else WindowSlotAllocator(
                self.max_total_tokens,
                info.window,
                device,
                budget=max(1, int(self.max_total_tokens * args.swa_full_tokens_ratio)),
            )
        )
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
        # Deciding and publishing a step's results (results.py); aborting requests (aborts.py).
        self.results = StepResults(
            args,
            executor,
            self.queues,
            self.reqs,
            self.kv,
            self.stats,
            self.outputs,
            self.tokenizer,
            self.grammar_queue,
            self.speculator,
            self.kv_slots,
            self.prefill_handoffs,
        )
        self._aborts = AbortParts(
            self.reqs,
            self.stats,
            self.queues,
            self.tree_cache,
            self.grammar_queue,
            self.outputs,
            self.prefill_handoffs,
            self.decode_handoffs,
        )
        # --enable/--disable-overlap-schedule: publish a step's results during the next forward.
        # A pipeline overlaps its own way: the publishing runs between its ticks.
        overlap = overlap_enabled(args, device) and self.pipeline is None
        self.publisher = OverlappedPublisher() if overlap else None
        # The last step's results, decided but not yet published (overlap schedule only).
        self._unpublished: Decided | None = None

        # Test hook (/slow_down): sleep this long before every forward.
        self.forward_delay = ForwardDelay()
        # When the forward step now running began (None between steps): what the watchdog checks.
        self.step_started: float | None = None
        self.profiler = StepProfiler()
        self.accounting = KVAccounting(self.kv, self.cache_tier, self.max_total_tokens)
        self.idle_check = IdleSelfCheck(executor, self.speculator, self.accounting)
        self.components = self._components()
        self.controls = Controls(self._control_parts())

    def _components(self) -> list[StepComponent]:
        """The features that act at the step's phases, in the order the step calls them."""
        finish = self.results.finish
        self.grammar_arrivals = GrammarArrivals(self.grammar_queue, self._enqueue, finish)
        components: list[StepComponent] = [self.grammar_arrivals, TierLoads(self.cache_tier)]
        if self.decode_handoffs is not None:
            start = self.results.handed_over
            components.append(HandoffArrivals(self.decode_handoffs, self.queues, self.stats, start, finish))
        if self.prefill_handoffs is not None:
            components.append(PrefillHandoffsClose(self.prefill_handoffs))
        if self.kv_events is not None:
            components.append(KVEventsFlush(self.kv_events))
        if self.speculator is not None:
            components.append(SpeculatorHooks(self.speculator))
        components.append(ProfilerHooks(self.profiler))
        return components

    def _control_parts(self) -> ControlParts:
        """What the control commands use (control.py), handed over once; the executor's optional
        capabilities narrowed here, not per command."""
        executor = self.executor
        return ControlParts(
            args=self.args,
            max_total_tokens=self.max_total_tokens,
            context_len=self.context_len,
            queues=self.queues,
            reqs=self.reqs,
            kv=self.kv,
            accounting=self.accounting,
            prefill=self.prefill,
            decode=self.decode,
            grammar_queue=self.grammar_queue,
            stats=self.stats,
            profiler=self.profiler,
            cache_tier=self.cache_tier,
            delay=self.forward_delay,
            executor=executor,
            memory=self.memory,
            weights=executor if isinstance(executor, WeightControl) else None,
            experts=executor if isinstance(executor, ExpertRecording) else None,
            overlap_schedule=self.publisher is not None,
            kv_events=self.kv_events,
            speculator=self.speculator,
            lora=self.lora,
            images=self.images,
            pipeline=self.pipeline,
            handoffs=self.prefill_handoffs or self.decode_handoffs,
            is_idle=lambda: self.is_idle,
            flush_cache=self.flush_cache,
            abort_all_and_flush=self.abort_all_and_flush,
        )

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
            return drained + self.controls.handle(msg)
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
        self.idle_check.request_arrived()
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
        return outputs + abort_requests(self._aborts, targets, message, status_code)

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
            self.idle_check.run()
        return published

    def _end_step(self, started: float, steps: int) -> list[SchedulerOutput]:
        for component in self.components:
            component.end_step()
        if self.stats.forward_steps > steps:
            self.stats.step_time_s += time.perf_counter() - started
        return self.controls.answer_idle_waiters()

    def _run_batch(self, batch: ScheduledBatch) -> list[ReqOutput]:
        """A generation step: its forward, then its results decided and published (with the overlap
        schedule, the previous step's are published during this forward, and this one's next)."""
        self._before_forward(batch, batch.is_prefill)
        unpublished, self._unpublished = self._unpublished, None
        publishing = None
        if unpublished is not None and self.publisher is not None:
            publishing = self.publisher.start(lambda: self.results.publish(unpublished))
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
            decided = self.results.verified(batch, logits, hidden)
        else:
            decided = self.results.sampled(batch, logits, hidden)
        seconds = time.perf_counter() - forward_started
        for component in self.components:
            component.after_results(batch, batch.is_prefill, seconds)
        if self.publisher is None:
            return published + self.results.publish(decided)
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
        return self.results.publish(self.results.sampled(landed, *result))

    def _before_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        self.stats.forward_steps += 1
        self.step_started = time.monotonic()
        if self.forward_delay.seconds:
            time.sleep(self.forward_delay.seconds)
        for component in self.components:
            component.before_forward(batch, is_prefill)

    def _after_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        self.step_started = None
        for component in self.components:
            component.after_forward(batch, is_prefill)

    def _drain_pipeline(self) -> list[ReqOutput]:
        """Runs ticks without launching until no micro-batch is in flight."""
        outputs: list[ReqOutput] = []
        while self.pipeline is not None and self.pipeline.in_flight:
            outputs += self._run_tick(self.pipeline, None)
        return outputs

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
        decided = self.results.decide(batch.reqs, batch.samples, batch.is_prefill, [()] * len(done))
        return self.results.publish(decided)

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

    # ------------------------------------------------------------------ results out (results.py)

    def _publish_unpublished(self) -> list[ReqOutput]:
        unpublished, self._unpublished = self._unpublished, None
        return [] if unpublished is None else self.results.publish(unpublished)

    # ------------------------------------------------------------------ the KV

    def check_kv_invariant(self) -> None:
        """Raises KVLeakError unless the KV accounting holds (accounting.py); only idle can pass."""
        self.accounting.check_invariant()

    @property
    def kv_events_pending(self) -> bool:
        """KV events recorded and not yet published: an idle scheduler steps once to send them."""
        return self.kv_events is not None and self.kv_events.recorder.pending

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
