"""The scheduler: one event loop that decides, step by step, what the model runs next.

Each step: take new messages → pick the next batch (a prefill of waiting requests if any can be
admitted, else one decode step of the running batch) → run it → append tokens, finish requests,
stream outputs. It owns the waiting queue, the running batch, the radix cache and the KV pools.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import ChunkCache, PrefixCache, RadixCache
from radixserve.config.server_args import ServerArgs
from radixserve.distributed.parallel import SINGLE, ParallelContext
from radixserve.executor.model_runner import ModelRunner
from radixserve.forward.batch import ForwardBatch
from radixserve.protocol.messages import (
    AbortRequest,
    ControlRequest,
    FinishReason,
    GenerateRequest,
    ReqOutput,
    SchedulerInput,
    SchedulerOutput,
    ShutdownRequest,
    TokenLogprobs,
)
from radixserve.protocol.prompts import PromptLimits
from radixserve.protocol.sampling_params import InvalidRequestError, SamplingParams
from radixserve.scheduler.batch import KVContext, KVExhaustedError, build_decode_batch, build_extend_batch
from radixserve.scheduler.control import handle_control
from radixserve.scheduler.grammar import GrammarQueue, InvalidGrammarError, grammar_key
from radixserve.scheduler.logit_processors import ProcessorRegistry
from radixserve.scheduler.logprobs import record_input_logprobs
from radixserve.scheduler.next_tokens import pick_next_tokens, record_prompt_hidden_states
from radixserve.scheduler.outputs import Decided, OutputBuilder, OverlappedPublisher, overlap_enabled
from radixserve.scheduler.policy import CLIP_MAX_NEW_TOKENS_ESTIMATE, AddResult, PrefillAdder, SchedulePolicy
from radixserve.scheduler.profiler import StepProfiler
from radixserve.scheduler.rank_sync import RankSync
from radixserve.scheduler.request import Req
from radixserve.scheduler.stats import SchedulerStats

logger = logging.getLogger("radixserve.scheduler")

DEFAULT_MAX_RUNNING_REQUESTS = 256
# new_token_ratio: the fraction of a running request's remaining max_new_tokens the prefill budget
# reserves for it. It starts cautious, decays while decoding goes well, and jumps on retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
# After a retraction, keep this many decode steps of headroom so the next step does not retract again.
RETRACT_HEADROOM_STEPS = 20
# With nothing to run but grammars compiling, wake up this often to check messages.
GRAMMAR_POLL_S = 0.01


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    forward: ForwardBatch
    is_prefill: bool


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner | None = None,
        tokenizer: Any = None,
        parallel: ParallelContext = SINGLE,
    ):
        # Only stop strings need text here; without a tokenizer one is loaded when first needed.
        self._tokenizer = tokenizer
        self.runner = runner or ModelRunner(args, parallel=parallel)
        self.rank_sync = RankSync(parallel)
        if self.runner.config.is_encoder:
            # Bidirectional attention: a text runs whole, and its K/V cannot serve another text.
            args = dataclasses.replace(args, chunked_prefill_size=None, disable_radix_cache=True)
        self.args = args
        self.config = self.runner.config
        self.context_len = self.runner.context_len
        self.max_total_tokens = self.runner.max_total_tokens
        self.max_running = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        self.prompt_limits = PromptLimits(self.context_len, self.max_total_tokens, allow_auto_truncate=False)
        device = self.runner.device
        # One spare request slot: a request being prefilled in chunks is not counted as running.
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running + 1, self.context_len + args.page_size, device
        )
        self.allocator = KVSlotAllocator(self.max_total_tokens, args.page_size, device)
        self.tree_cache: PrefixCache = (
            ChunkCache(self.req_to_token_pool, self.allocator, args.page_size)
            if args.disable_radix_cache
            else RadixCache(self.req_to_token_pool, self.allocator, args.page_size)
        )
        self.kv = KVContext(self.req_to_token_pool, self.allocator, self.tree_cache, device)
        self.policy = SchedulePolicy(args.schedule_policy, self.tree_cache, args.random_seed)
        self.eos_token_ids = frozenset(self.config.eos_token_ids)
        self.logit_processors = ProcessorRegistry(args.enable_custom_logit_processor)
        self._next_stand_in_id = self.config.vocab_size

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.grammar_queue = GrammarQueue(
            args.grammar_backend,
            args.grammar_timeout,
            self._get_tokenizer,
            self.config.vocab_size,
            agree=self.rank_sync.agree,
        )
        self.chunked_req: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.outputs = OutputBuilder()
        # --enable/--disable-overlap-schedule: publish a step's results during the next forward.
        self.publisher = OverlappedPublisher() if overlap_enabled(args, device) else None
        # The last step's results, decided but not yet published (overlap schedule only).
        self._unpublished: Decided | None = None

        self.reset_new_token_ratio()
        self.stats = SchedulerStats()
        # Test hook (/slow_down): sleep this long before every forward.
        self.forward_sleep_s = 0.0
        # When the forward step now running began (None between steps): what the watchdog checks.
        self.step_started: float | None = None
        self.profiler = StepProfiler()
        self._idle_checked = True
        self.idle_waiters: list[ControlRequest] = []

    def reset_new_token_ratio(self) -> None:
        conservativeness = self.args.schedule_conservativeness
        self.init_new_token_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * conservativeness)
        self.min_new_token_ratio = self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio_decay = (
            self.init_new_token_ratio - self.min_new_token_ratio
        ) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio

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
            return list(self.abort(msg.rid, abort_all=msg.abort_all))
        if isinstance(msg, ControlRequest):
            return handle_control(self, msg)
        raise TypeError(f"unexpected scheduler message {type(msg).__name__}")

    def add_request(self, msg: GenerateRequest) -> list[ReqOutput]:
        if self.runner.released:
            message = f"the {' and '.join(sorted(self.runner.released))} memory is released; "
            message += "call /resume_memory_occupation first"
            finish = FinishReason("abort", message=message, status_code=503)
            return [ReqOutput(msg.rid, [], finish, len(msg.input_ids), 0, 0)]
        ids, vectors = list(msg.input_ids), None
        try:
            params = SamplingParams.from_dict(msg.sampling_params)
            params.check_vocab(self.config.vocab_size)
            processor = None
            if msg.custom_logit_processor is not None:
                processor = self.logit_processors.get(msg.custom_logit_processor)
            if msg.input_embeds is not None:
                vectors = self._prompt_vectors(msg.input_embeds)
                ids = self._stand_in_ids(len(vectors))
            self._validate_input(msg.rid, ids, real_ids=vectors is None)
        except InvalidRequestError as exc:
            return [self.outputs.error(msg.rid, len(ids), str(exc))]
        prompt_len = len(ids)
        if self.runner.is_embedding:
            params.max_new_tokens = 0  # the prompt's pass gives the embedding; nothing is sampled
        # Clip to what the context and the whole KV pool can hold, so a lone request always fits.
        params.max_new_tokens = min(
            params.max_new_tokens, self.context_len - prompt_len, self.max_total_tokens - prompt_len
        )
        req = Req(
            msg.rid,
            ids,
            params,
            eos_token_ids=self.eos_token_ids,
            last_node=self.tree_cache.root,
            input_embeds=vectors,
            return_hidden_states=msg.return_hidden_states,
            logit_processor=processor,
        )
        if params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        if msg.return_logprob:
            req.logprobs = TokenLogprobs()
            req.top_logprobs_num = msg.top_logprobs_num
            req.token_ids_logprob = msg.token_ids_logprob
            if msg.logprob_start_len >= 0:
                req.input_logprobs = TokenLogprobs()
                req.input_logprob_next = max(1, msg.logprob_start_len)
        if params.max_new_tokens == 0 and not req.needs_input_logprobs and not self.runner.is_embedding:
            req.finished_reason = FinishReason("length")
            return [self.outputs.final(req)]
        self.reqs[req.rid] = req
        self._idle_checked = False
        if (key := grammar_key(params)) is not None:
            try:
                self.grammar_queue.add(req, key)
            except InvalidGrammarError as exc:
                del self.reqs[req.rid]
                return [self.outputs.error(msg.rid, prompt_len, str(exc))]
            return self._move_ready_grammar_requests()
        self.waiting.append(req)
        return []

    def _move_ready_grammar_requests(self) -> list[ReqOutput]:
        ready, failed = self.grammar_queue.poll()
        self.waiting += ready
        outputs = []
        for req, error in failed:
            # The request's own fault (a bad grammar): answered like invalid input.
            req.finished_reason = FinishReason("abort", message=error, status_code=400)
            outputs.append(self._finish(req))
        return outputs

    def _prompt_vectors(self, rows: list[list[float]]) -> torch.Tensor:
        hidden = self.config.hidden_size
        if not rows or any(len(row) != hidden for row in rows):
            raise InvalidRequestError(f"input_embeds must be a non-empty list of vectors of {hidden} numbers")
        return torch.tensor(rows, dtype=self.runner.dtype, device=self.runner.device)

    def _stand_in_ids(self, length: int) -> list[int]:
        """Ids for a prompt given as vectors: above the vocabulary and never reused, so the radix
        cache cannot match them against any other prompt (only the request's own, on resume)."""
        first = self._next_stand_in_id
        self._next_stand_in_id += length
        return list(range(first, first + length))

    def _validate_input(self, rid: str, ids: list[int], real_ids: bool = True) -> None:
        if rid in self.reqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.config.vocab_size
        if real_ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        # The engine checked (or cut) the length already; the scheduler can be driven directly.
        self.prompt_limits.allowed_prompt_len(len(ids), embed=self.runner.is_embedding)

    def abort_all_and_flush(self) -> list[SchedulerOutput]:
        """After a weight change: requests in flight hold KV of the old weights, and so does the cache."""
        outputs: list[SchedulerOutput] = []
        for req in list(self.reqs.values()):
            outputs += self.abort(req.rid)
        self.flush_cache()
        return outputs

    def abort(self, rid: str | None, abort_all: bool = False) -> list[ReqOutput]:
        targets = list(self.reqs.values()) if abort_all else [self.reqs[rid]] if rid in self.reqs else []
        outputs = []
        for req in targets:
            req.abort("aborted by request")
            self.stats.aborted_reqs += 1
            if req in self.waiting:
                self.waiting.remove(req)
            elif not self.grammar_queue.remove(req):  # one still compiling holds nothing yet
                # Between steps no forward is in flight, so the KV can be released right away.
                self._release_kv(req)
                if req is self.chunked_req:
                    self.chunked_req = None
                if req in self.running:
                    self.running.remove(req)
            outputs.append(self._finish(req))
        return outputs

    # ------------------------------------------------------------------ one step

    def step(self) -> list[SchedulerOutput]:
        started, steps = time.perf_counter(), self.stats.forward_steps
        outputs: list[SchedulerOutput] = []
        if self.grammar_queue.pending:
            outputs += self._move_ready_grammar_requests()
        outputs += self._run_one_batch()
        if self.stats.forward_steps > steps:
            self.stats.step_time_s += time.perf_counter() - started
        if self.idle_waiters and self.is_idle:
            waiters, self.idle_waiters = self.idle_waiters, []
            for msg in waiters:
                outputs += handle_control(self, msg)
        return outputs

    def _run_one_batch(self) -> list[ReqOutput]:
        batch = self._next_batch()
        if batch is None:
            published = self._publish_unpublished()
            if self.grammar_queue.pending:
                # Only grammars are left to wait for: sleep on them instead of spinning.
                self.grammar_queue.wait(GRAMMAR_POLL_S)
                return published
            self._check_idle()
            return published
        self.stats.forward_steps += 1
        self.profiler.before_step(batch.is_prefill)
        self.step_started = time.monotonic()
        if self.forward_sleep_s:
            time.sleep(self.forward_sleep_s)
        if self.runner.is_embedding:
            return self._run_embedding_batch(batch)
        unpublished, self._unpublished = self._unpublished, None
        publishing = None
        if unpublished is not None and self.publisher is not None:
            publishing = self.publisher.start(lambda: self._publish(unpublished))
            self.stats.overlapped_steps += 1
        forward_started = time.perf_counter()
        try:
            logits, hidden = self.runner.forward(batch.forward)
        finally:
            # Joined even when the forward fails: nothing may touch the cache while it runs.
            published = [] if publishing is None else publishing.result()
        self.stats.forward_time_s += time.perf_counter() - forward_started
        self.step_started = None
        self.profiler.after_step(batch.is_prefill)
        sampling_reqs = [r for r in batch.reqs if r.kv_len == r.seq_len]
        if batch.forward.logprob_rows is not None:
            record_input_logprobs(batch.reqs, logits[len(sampling_reqs) :])
            logits = logits[: len(sampling_reqs)]
        if batch.forward.hidden_rows is not None:
            record_prompt_hidden_states(batch.reqs, hidden[len(hidden) - len(batch.forward.hidden_rows) :])
        next_ids: list[int] = []
        if sampling_reqs:
            next_ids = pick_next_tokens(
                sampling_reqs, logits, hidden, self.config.vocab_size, self.runner.sample, self._grammar_mask
            )
        decided = self._decide(batch, dict(zip(map(id, sampling_reqs), next_ids, strict=True)))
        if self.publisher is None:
            return published + self._publish(decided)
        self._unpublished = decided
        return published

    def _run_embedding_batch(self, batch: ScheduledBatch) -> list[ReqOutput]:
        """Embedding requests finish with their prompt's pass (a chunk of a long one only fills KV)."""
        embeddings = self.runner.embed(batch.forward).tolist()
        self.step_started = None
        self.profiler.after_step(batch.is_prefill)
        done = [r for r in batch.reqs if r.kv_len == r.seq_len]
        for req, vector in zip(done, embeddings, strict=True):
            req.embedding = vector
        return self._publish(self._decide(batch, {}))

    def _grammar_mask(self, reqs: list[Req], device: torch.device) -> torch.Tensor | None:
        if all(r.grammar is None for r in reqs):
            return None
        return self.grammar_queue.backend.bitmask([r.grammar for r in reqs], device)

    @property
    def is_idle(self) -> bool:
        return not (
            self.waiting
            or self.running
            or self.chunked_req
            or self.grammar_queue.pending
            or self._unpublished is not None
        )

    def _next_batch(self) -> ScheduledBatch | None:
        prefill = self._prefill_batch()
        if prefill is not None:
            return prefill
        if self.running:
            return self._decode_batch()
        return None

    def _prefill_batch(self) -> ScheduledBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        running = len(self.running)
        if running >= self.max_running and self.chunked_req is None:
            return None
        mix = bool(self.args.enable_mixed_chunk and self.running)
        decode_tokens = running if mix else 0
        chunk = self.args.chunked_prefill_size
        adder = PrefillAdder(
            tree_cache=self.tree_cache,
            available_slots=self.allocator.available_size(),
            running_reserved=self._running_reserve() + decode_tokens,
            max_prefill_tokens=self.args.max_prefill_tokens - decode_tokens,
            chunk_budget=None if chunk is None else max(self.args.page_size, chunk - decode_tokens),
            page_size=self.args.page_size,
        )
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        for req in self.policy.order(self.waiting):
            if running + len(adder.can_run) >= self.max_running:
                break
            if adder.add_one_req(req, has_chunked_req=self.chunked_req is not None) is not AddResult.CONTINUE:
                break
        if not adder.can_run:
            return None

        admitted = {id(r) for r in adder.can_run}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        reqs = list(adder.can_run)
        if mix:
            for req in self.running:
                req.extend_len = 1
            reqs += self.running
        forward = build_extend_batch(reqs, self.kv)
        in_progress = [r for r in adder.can_run if r.kv_len < r.seq_len]
        self.chunked_req = in_progress[0] if in_progress else None
        self.stats.log_prefill(
            len(adder.can_run),
            adder.prefill_tokens,
            adder.cached_tokens,
            self.token_usage(),
            len(self.running),
            len(self.waiting),
        )
        return ScheduledBatch(reqs, forward, is_prefill=True)

    def _running_reserve(self) -> float:
        return (
            sum(min(r.remaining_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATE) for r in self.running)
            * self.new_token_ratio
        )

    def _decode_batch(self) -> ScheduledBatch:
        if self.kv.available_with_eviction() < self.kv.slots_needed_for_decode(self.running):
            self._retract()
        else:
            self.new_token_ratio = max(
                self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio
            )
        forward = build_decode_batch(self.running, self.kv)
        self.stats.record_decode(len(self.running))
        if self.stats.decode_steps % self.args.decode_log_interval == 0:
            used = self.max_total_tokens - self.kv.available_with_eviction()
            self.stats.log_decode(len(self.running), used, self.token_usage(), len(self.waiting))
        return ScheduledBatch(list(self.running), forward, is_prefill=False)

    def _retract(self) -> None:
        """Free KV for the decode step by sending requests back to the queue, fewest outputs first."""
        # Most progressed first, so that popping from the end retracts the cheapest to redo.
        keep = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        retracted: list[Req] = []
        while len(keep) > 1 and self.kv.available_with_eviction() < (
            self.kv.slots_needed_for_decode(keep) + RETRACT_HEADROOM_STEPS * len(keep)
        ):
            victim = keep.pop()
            self._release_kv(victim)
            victim.retractions += 1
            retracted.append(victim)
        if (
            self.chunked_req is not None
            and self.kv.available_with_eviction() < self.kv.slots_needed_for_decode(keep)
        ):
            victim = self.chunked_req
            self._release_kv(victim)
            victim.retractions += 1
            retracted.append(victim)
            self.chunked_req = None
        if self.kv.available_with_eviction() < self.kv.slots_needed_for_decode(keep):
            raise KVExhaustedError("a single running request does not fit in the KV cache; this is a bug")

        kept = {id(r) for r in keep}
        self.running = [r for r in self.running if id(r) in kept]
        self.waiting.extend(retracted)
        self.stats.retracted_reqs += len(retracted)
        decoded = sum(len(r.output_ids) for r in self.running)
        budget = sum(r.sampling_params.max_new_tokens for r in self.running)
        estimate = (decoded + RETRACT_HEADROOM_STEPS * len(self.running)) / max(budget, 1)
        old = self.new_token_ratio
        self.new_token_ratio = min(1.0, max(estimate, old + 0.1))
        logger.info(
            "KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
            len(retracted),
            old,
            self.new_token_ratio,
        )

    # ------------------------------------------------------------------ results out

    def _decide(self, batch: ScheduledBatch, next_ids: dict[int, int]) -> Decided:
        """Everything about the step's results that the next batch depends on (outputs.py)."""
        decided = Decided()
        # Sets, not list scans: this runs for every request on every step.
        running = {id(r) for r in self.running}
        finished: set[int] = set()
        for req in batch.reqs:
            if req.kv_len < req.seq_len:
                # A chunk of a long prompt: publish the computed part so later requests can share it.
                self.tree_cache.cache_unfinished_req(req, req.fill_ids)
                continue
            if req.sampling_params.max_new_tokens == 0:
                # Prefilled only for its prompt logprobs (a scoring request): nothing to output.
                req.finished_reason = FinishReason("length")
            else:
                req.output_ids.append(next_ids[id(req)])
                if len(req.output_ids) == 1:
                    self.stats.record_first_token(time.monotonic() - req.arrival_time)
                if req.grammar is not None:
                    req.grammar.accept(req.output_ids[-1])
                    if req.grammar.terminated:
                        req.finished_reason = FinishReason("stop", matched=req.output_ids[-1])
            req.check_finished(self.context_len, self._decode if req.sampling_params.stop else None)
            if req.finished:
                # Out of reach of aborts now; its KV is released when it is published.
                self.reqs.pop(req.rid, None)
                finished.add(id(req))
                decided.reqs.append((req, True))
                continue
            if batch.is_prefill and id(req) not in running:
                self.tree_cache.cache_unfinished_req(req, req.fill_ids)
                self.running.append(req)
            if self.outputs.unsent_tokens(req) >= self.args.stream_interval:
                decided.reqs.append((req, False))
        if finished:
            self.running = [r for r in self.running if id(r) not in finished]
        self.stats.generated_tokens += len(next_ids)
        return decided

    def _publish(self, decided: Decided) -> list[ReqOutput]:
        """Releases finished requests' KV into the cache and builds the outputs (outputs.py)."""
        outputs = []
        for req, finished in decided.reqs:
            if finished:
                self._release_kv(req)
                outputs.append(self.outputs.final(req))
            else:
                outputs.append(self.outputs.progress(req))
        return outputs

    def _publish_unpublished(self) -> list[ReqOutput]:
        unpublished, self._unpublished = self._unpublished, None
        return [] if unpublished is None else self._publish(unpublished)

    def _get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from radixserve.models.loader import load_tokenizer, resolve_model_source

            self._tokenizer = load_tokenizer(
                resolve_model_source(self.args.tokenizer_path or self.args.model_path)
            )
        return self._tokenizer

    def _decode(self, ids: list[int]) -> str:
        text: str = self._get_tokenizer().decode(ids)
        return text

    def _release_kv(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        self.tree_cache.cache_finished_req(req, req.fill_ids)

    def _finish(self, req: Req) -> ReqOutput:
        self.reqs.pop(req.rid, None)
        return self.outputs.final(req)

    # ------------------------------------------------------------------ accounting

    def token_usage(self) -> float:
        return 1.0 - self.kv.available_with_eviction() / self.max_total_tokens

    def _check_idle(self) -> None:
        if self._idle_checked:
            return
        self.runner.idle()
        self.check_kv_invariant()
        self._idle_checked = True

    def check_kv_invariant(self) -> None:
        """Raises KVLeakError unless every KV slot is free or evictable and every request slot is free."""
        self.tree_cache.check_invariant()

    def flush_cache(self) -> bool:
        if not self.is_idle:
            return False
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return True

    # ------------------------------------------------------------------ event loop

    def event_loop(
        self,
        receive: Callable[[bool], list[SchedulerInput]],
        emit: Callable[[list[SchedulerOutput]], None],
    ) -> None:
        """receive → process → next batch → run → process result, until a ShutdownRequest.

        `receive(block)` returns the messages that arrived; it may wait only when block is True,
        which happens when the scheduler has nothing else to do.
        """
        while True:
            outputs: list[SchedulerOutput] = []
            for msg in receive(self.is_idle):
                if isinstance(msg, ShutdownRequest):
                    self.grammar_queue.shutdown()
                    if self.publisher is not None:
                        self.publisher.shutdown()
                    self.runner.close()
                    return
                outputs += self.handle(msg)
            outputs += self.step()
            if outputs:
                emit(outputs)
