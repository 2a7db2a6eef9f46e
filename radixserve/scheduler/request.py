"""Req: one generation request as the scheduler tracks it, and the reasons it can finish."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from radixserve.cache.key_space import namespaced
from radixserve.cache.radix_cache import TreeNode
from radixserve.cache.tiers import TierLoad
from radixserve.layers.sampler import SamplingRow
from radixserve.protocol.messages import BootstrapInfo, FinishReason, TokenLogprobs
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.grammar import CompileResult, GrammarMatcher
from radixserve.scheduler.logit_processors import LogitProcessor

_arrival_counter = itertools.count()


# Speculative decoding's odds that a draft is accepted given its parent was: a Beta(1, 1) prior,
# and the share of the evidence a step without a verify keeps (so old failures fade: slowly, as
# each retry of a request that keeps failing costs a verify step).
PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0
IDLE_DECAY = 0.97


# Stand-in ids of image tokens live in [2^31, 2^32): above any vocabulary and the stand-ins of
# prompts given as vectors, inside the 32 bits cache/key_space.py leaves token ids.
IMAGE_ID_BASE = 1 << 31


@dataclass
class ImageSpan:
    """One image of a request: its tokens are prompt positions [offset, offset + length)."""

    offset: int
    length: int
    digest: str
    pixel_values: torch.Tensor  # [channels, height, width], float32
    # [length, hidden]: set while a prefill chunk needs them (ImageEncoder.prepare).
    embeds: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class SpeculationState:
    """A request's part in speculative decoding (scheduler/speculative/)."""

    # How many of its tokens (prompt, then output) are in the shared n-gram index.
    indexed: int = 0
    # Decayed evidence on its drafts: accepted ones, and rejections (a verify step that stopped
    # at a node with children).
    accepted: float = 0.0
    rejected: float = 0.0
    # STANDALONE: the draft model's K/V holds this request's positions [0, draft_len), worked out
    # at the admission numbered draft_admission (speculative/draft_model.py).
    draft_len: int = 0
    draft_admission: int = -1
    # NGRAM: the first tokens of drafts offered for a step that then ran without a verify (the
    # cost gate declined it), and the output length then. The token that step emitted shows whether
    # they would have been accepted, for free; without this a request whose odds once fell would
    # stay judged by old failures while its text turned copyable.
    shadow: frozenset[int] = frozenset()
    shadow_at: int = -1

    @property
    def accept_odds(self) -> float:
        """The estimated chance that a draft is accepted given that its parent was."""
        seen = self.accepted + self.rejected + PRIOR_ACCEPTED + PRIOR_REJECTED
        return (self.accepted + PRIOR_ACCEPTED) / seen

    def record(self, accepted: int, rejected: bool) -> None:
        self.accepted += accepted
        self.rejected += 1.0 if rejected else 0.0

    def sit_out(self) -> None:
        self.accepted *= IDLE_DECAY
        self.rejected *= IDLE_DECAY

    def offer_shadow(self, first_tokens: frozenset[int], output_len: int) -> None:
        self.shadow, self.shadow_at = first_tokens, output_len

    def settle_shadow(self, output_ids: list[int]) -> None:
        """Counts the shadow drafts as one verify step would have, once the step after them has
        emitted exactly one token (else, after a retraction or a verify step, drops them)."""
        if self.shadow and len(output_ids) == self.shadow_at + 1:
            hit = output_ids[self.shadow_at] in self.shadow
            self.record(1 if hit else 0, rejected=not hit)
        self.shadow, self.shadow_at = frozenset(), -1


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    arrival_time: float = field(default_factory=time.monotonic)
    # When the scheduler took the request (None: not through the event loop), and whether it was
    # idle then: an idle scheduler takes every request waiting at that moment at once, a busy one
    # takes requests between its steps.
    received_at: float | None = None
    received_idle: bool = False
    finished_reason: FinishReason | None = None
    # The request's `priority` (0 when it gave none); only --enable-priority-scheduling reads it.
    priority: int = 0
    # Whether its caller reads its output as it comes (GenerateRequest.stream).
    stream: bool = True

    # KV ownership (see cache/radix_cache.py): positions [0, cached_len) belong to the radix tree
    # and are locked through last_node; [cached_len, kv_len) belong to this request.
    req_pool_idx: int | None = None
    # A serial number taken with the request slot at each (re)admission: K/V copied while it holds
    # (decode staging) stays valid, since only a retraction can change its KV slots.
    admission: int = -1
    cached_len: int = 0
    kv_len: int = 0
    # With window slots (cache/swa_pool.py): the sliding layers' K/V of this request's own
    # positions before this one have been released.
    window_released: int = 0
    # The scheduler passes the cache's root; a node of its own only stands in until then.
    last_node: TreeNode = field(default_factory=TreeNode)

    # Set by the prefill adder for the next extend: the cached prefix found for fill_ids and
    # how many of the remaining tokens this step computes.
    prefix_slots: torch.Tensor | None = None
    prefix_node: TreeNode | None = None
    extend_len: int = 0

    # The storage tier's load of more of this prompt's prefix, which it waits in the queue for
    # (cache/tiers.py); tier_checked: looked up once, when the scheduler first considered it.
    tier_load: TierLoad | None = None
    tier_checked: bool = False
    # Prompt tokens served from the cache, and how far this request has computed on its own
    # (so that resuming after retraction or a chunk does not count its own KV as a cache hit).
    cached_tokens: int = 0
    computed_len: int = 0
    retractions: int = 0
    generator: torch.Generator | None = None
    # Set when the request asked for logprobs; one entry per output token.
    logprobs: TokenLogprobs | None = None
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    # Set when it asked for prompt logprobs: one entry per prompt token from the first one asked
    # for (never token 0, which nothing predicts); input_logprob_next is the next token to cover.
    input_logprobs: TokenLogprobs | None = None
    input_logprob_next: int = 0
    input_logprobs_sent: bool = False
    # Positions [start, end) of the current extend whose logits give prompt logprobs.
    input_logprob_positions: tuple[int, int] | None = None
    # Structured output: the compile job while in the grammar queue, then the matcher.
    grammar_key: tuple[str, str] | None = None
    grammar_job: Future[CompileResult] | None = None
    grammar_deadline: float = 0.0
    grammar: GrammarMatcher | None = None
    # Embedding models: the pooled vector, once the prompt has run.
    embedding: list[float] | None = None
    # A prompt given as vectors: [prompt_len, hidden]. origin_input_ids then holds stand-in ids that
    # no real token or other request shares (see Scheduler.add_request), so the radix cache keeps
    # such a prompt to itself.
    input_embeds: torch.Tensor | None = None
    # With return_hidden_states: the final hidden state at every prompt position but the last
    # (collected while prefilling; positions [start, end) of the current extend), and the one
    # behind each output token (the last prompt position's comes first).
    return_hidden_states: bool = False
    prompt_hidden_states: list[list[float]] = field(default_factory=list)
    prompt_hidden_positions: tuple[int, int] | None = None
    prompt_hidden_sent: bool = False
    hidden_states: list[list[float]] = field(default_factory=list)
    # A custom logit processor (scheduler/logit_processors.py), when the request names one.
    logit_processor: LogitProcessor | None = None
    speculation: SpeculationState = field(default_factory=SpeculationState)
    # Under --disaggregation-mode: the request's other half (scheduler/disaggregation/).
    bootstrap: BootstrapInfo | None = None
    # --enable-lora: the adapter it runs with (None: the base model), the adapter slot it has in
    # the batch being built, and the namespace its K/V is cached in (cache/key_space.py).
    lora_name: str | None = None
    lora_slot: int | None = None
    cache_namespace: int = 0
    # Vision-language models: the prompt's images (scheduler/images.py); their tokens hold
    # stand-in ids at or above IMAGE_ID_BASE.
    images: list[ImageSpan] = field(default_factory=list)
    # What the sampler takes from sampling_params, worked out once (its sampling fields are fixed
    # from admission on) rather than on every step.
    sampling_row: SamplingRow = field(init=False)

    def __post_init__(self) -> None:
        self.sampling_row = SamplingRow.of(self.sampling_params)

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV a resumed request must have: the prompt and what it has output."""
        return self.origin_input_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """fill_ids as the prefix cache keys them: in the request's adapter's namespace."""
        return namespaced(self.fill_ids, self.cache_namespace)

    @property
    def penalized_prompt_ids(self) -> list[int]:
        """The prompt ids repetition penalties look at (none for a prompt given as vectors)."""
        if self.input_embeds is not None:
            return []
        if self.images:
            return [t for t in self.origin_input_ids if t < IMAGE_ID_BASE]
        return self.origin_input_ids

    @property
    def needs_prompt_hidden_states(self) -> bool:
        return self.return_hidden_states and len(self.prompt_hidden_states) < len(self.origin_input_ids) - 1

    @property
    def needs_input_logprobs(self) -> bool:
        return self.input_logprobs is not None and self.input_logprob_next < len(self.origin_input_ids)

    def prefix_match_ids(self) -> list[int]:
        """The ids whose cached KV this request may reuse: not the last one (its logits are needed
        to sample), and nothing from the first position whose logits a prompt logprob needs."""
        limit = self.seq_len - 1
        if self.needs_input_logprobs:
            limit = min(limit, max(0, self.input_logprob_next - 1))
        if self.needs_prompt_hidden_states:
            # A cached position has its K/V but not its hidden state: recompute from there on.
            limit = min(limit, len(self.prompt_hidden_states))
        return self.cache_ids[:limit]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling_params.max_new_tokens - len(self.output_ids))

    def stop_token_ids(self) -> list[int]:
        """The ids that end this request: EOS (unless ignored) and its stop_token_ids."""
        params = self.sampling_params
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    def banned_token_ids(self) -> list[int]:
        """Tokens the sampler must not pick now: the stop tokens, until min_new_tokens are out."""
        if len(self.output_ids) >= self.sampling_params.min_new_tokens:
            return []
        return self.stop_token_ids()

    def check_finished(self, context_len: int, decode: Callable[[list[int]], str] | None = None) -> None:
        """Sets finished_reason if the last token ended the request. `decode` turns ids into text;
        it is needed only for stop strings. (Called for every request on every step: locals and
        no property calls.)"""
        output_ids = self.output_ids
        if self.finished_reason is not None or not output_ids:
            return
        params = self.sampling_params
        length = len(output_ids)
        if length >= params.min_new_tokens:
            last = output_ids[-1]
            if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
                self.finished_reason = FinishReason("stop", matched=last)
                return
            if params.stop and (matched := self._matched_stop_string(decode)) is not None:
                self.finished_reason = FinishReason("stop", matched=matched)
                return
        if length >= params.max_new_tokens or length + len(self.origin_input_ids) >= context_len:
            self.finished_reason = FinishReason("length")

    def _matched_stop_string(self, decode: Callable[[list[int]], str] | None) -> str | None:
        if decode is None:
            raise RuntimeError("stop strings need a tokenizer to decode with")
        stops = self.sampling_params.stop
        # Every token is at least one byte, so this many tokens hold any stop string that ends in
        # the last token; earlier matches would have finished the request already.
        tail_tokens = max(len(s.encode()) for s in stops) + 1
        tail = decode(self.output_ids[-tail_tokens:])
        return next((s for s in stops if s in tail), None)

    def abort(self, message: str, status_code: int | None = None) -> None:
        if self.finished_reason is None:
            self.finished_reason = FinishReason("abort", message=message, status_code=status_code)
