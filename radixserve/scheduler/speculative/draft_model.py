"""STANDALONE speculative decoding: a smaller model with the same tokenizer drafts each request's
next tokens, greedily, and the target model verifies them as a chain.

The draft model runs behind the Executor interface with a KV pool of its own, as large as the
target's and indexed by the same slots. The scheduler's one allocator, radix cache, retraction and
truncate_kv then govern both pools: a rejected draft's slot goes back for both at once, and no
draft slot is counted apart.

The draft's K/V at a slot is good only where the draft model itself computed it, for the token
the slot holds now. The target writes most slots alone (prefills, plain decode steps), so `valid`
marks the slots whose draft K/V is good, and each request keeps draft_len, how many of its
positions the draft model has (SpeculationState). A verify step:

1. takes the chains' slots (allocate_verify_slots);
2. runs one draft extend per drafting request over positions [draft_len, seq_len): it catches the
   draft up on what the target computed alone, ends at the root (the last sampled token, at
   kv_len) and gives the first draft;
3. runs k - 1 draft decode steps in the chain's next slots;
4. hands the chains to the target's verify forward, which writes its own K/V in the same slots.

A request further behind than the chunked-prefill size is caught up one chunk per step and does not
draft until it has caught up, so no step runs an unbounded draft extend. After the step draft_len
is the request's new kv_len, capped at what the draft computed (the last draft's K/V is only ever
the target's). A request admitted from the radix cache starts from its prefix's valid slots.

A wrong or stale draft can only lower the accept rate, never change an output: every emitted token
is drawn from the target (verify.py accepts a draft only when it is what the target drew), which
keeps the target's output distribution for any sampling parameters.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from radixserve.config.server_args import ServerArgs
from radixserve.executor.base import DraftExecutor
from radixserve.forward.batch import ExtendSegment, ForwardBatch, ForwardMode, build_decode_layout
from radixserve.forward.draft_tree import DraftTree
from radixserve.scheduler.batch import KVContext, allocate_verify_slots, token_range
from radixserve.scheduler.request import Req, SpeculationState
from radixserve.scheduler.speculative.worker import Speculator, VerifyPlan, agree_alone, speculates

# How far a draft extend catches a request up in one step when chunked prefill is off.
DEFAULT_CATCH_UP_TOKENS = 2048


class DraftModelSpeculator(Speculator):
    def __init__(
        self,
        args: ServerArgs,
        context_len: int,
        row_len: int,
        draft: DraftExecutor,
        vocab_size: int,
        agree: Callable[[list[int]], list[int]] = agree_alone,
    ):
        """draft: the draft model, its KV pool at least as large as the target's. vocab_size: the
        target's; drafts stay below it."""
        super().__init__(args, context_len, row_len, agree)
        assert args.speculative_num_steps is not None, "validate_speculative_args sets it"
        self.draft = draft
        self.num_steps = args.speculative_num_steps
        self.vocab_size = vocab_size
        self.catch_up_tokens = args.chunked_prefill_size or DEFAULT_CATCH_UP_TOKENS
        info = draft.info
        self.valid = torch.zeros(info.max_total_tokens, dtype=torch.bool, device=info.device)
        # Time spent drafting since the last step was measured: part of what a verify step costs.
        self.draft_seconds = 0.0
        # Each draft decode forward gets ids of its own: K/V a backend keeps between decode steps
        # (attention/staging.py) must not outlive a catch-up that rewrites the positions it holds.
        self._forward_ids = itertools.count()

    # ------------------------------------------------------------------ hooks

    def written(self, slots: torch.Tensor) -> None:
        self.valid[slots] = False

    def observe_forward(self, tokens: int, seconds: float, plain: bool) -> None:
        if not plain:
            seconds += self.draft_seconds
        self.draft_seconds = 0.0
        super().observe_forward(tokens, seconds, plain)

    def reset(self) -> None:
        self.valid.zero_()

    def idle(self) -> None:
        self.draft.idle()

    def release_memory(self, tags: set[str]) -> None:
        self.draft.release_memory(tags)
        if "kv_cache" in tags:
            self.valid.zero_()

    def resume_memory(self, tags: set[str]) -> None:
        self.draft.resume_memory(tags)

    # ------------------------------------------------------------------ before the forward

    def plan(self, reqs: list[Req], kv: KVContext) -> VerifyPlan | None:
        """The verify step of the running requests' drafted chains, or None for a plain decode step
        (no request drafts, drafting does not pay, or the KV pool cannot hold the chains)."""
        if self.adaptive and self.cost.needs_plain_step:
            return None
        min_reach = self.cost.reach_threshold(len(reqs)) if self.adaptive else 0.0
        depths: list[int] = []
        behind: list[Req] = []
        expected_extra = 0.0  # the drafts' summed chance of being emitted
        for req in reqs:
            state = self._sync(req, kv)
            depth = 0
            if speculates(req) and req.input_embeds is None:
                # Emitting depth + 1 tokens must stay within max_new_tokens, the context and the row.
                depth = min(
                    self.num_steps,
                    req.remaining_new_tokens - 1,
                    self.context_len - req.seq_len - 1,
                    self.row_len - req.kv_len - 1,
                )
                odds = state.accept_odds if self.adaptive else 1.0
                while depth > 0 and odds**depth < min_reach:
                    depth -= 1
                if req.seq_len - state.draft_len > self.catch_up_tokens:
                    depth = 0
                    behind.append(req)
                if depth <= 0:
                    depth = 0
                    state.sit_out()
                expected_extra += sum(odds**d for d in range(1, depth + 1))
            depths.append(depth)
        drafts = sum(depths)
        page = kv.allocator.page_size
        if (
            drafts == 0
            or (self.adaptive and not self.cost.worth_verifying(len(reqs), drafts, expected_extra))
            or kv.available_with_eviction() < drafts + len(reqs) * (1 + page)
        ):
            if behind:
                self._timed(lambda: self._extend(self._catch_up(behind), kv))
            return None
        starts = [r.kv_len for r in reqs]
        out_cache_loc = allocate_verify_slots(reqs, [d + 1 for d in depths], kv)
        # The target writes these; the draft marks again the ones it computes itself.
        self.valid[out_cache_loc] = False
        chains = self._timed(lambda: self._draft_chains(reqs, depths, behind, kv))
        trees = [DraftTree.chain(req.output_ids[-1], chain) for req, chain in zip(reqs, chains, strict=True)]
        return VerifyPlan(trees, [speculates(r) for r in reqs], starts, out_cache_loc)

    def _sync(self, req: Req, kv: KVContext) -> SpeculationState:
        """Brings the request's draft_len up to date: worked out from `valid` once per admission
        (its slots are new then), else capped at its kv_len (a verify step kept fewer)."""
        state = req.speculation
        if state.draft_admission != req.admission:
            row = kv.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len]
            missing = (~self.valid[row]).nonzero()
            state.draft_len = int(missing[0]) if missing.numel() else req.kv_len
            state.draft_admission = req.admission
        state.draft_len = min(state.draft_len, req.kv_len)
        return state

    def _timed(self, work: Callable[[], list[list[int]]]) -> list[list[int]]:
        started = time.perf_counter()
        try:
            return work()
        finally:
            self.draft_seconds += time.perf_counter() - started

    def _catch_up(self, behind: list[Req]) -> list[tuple[Req, int, int, bool]]:
        """One chunk of catching up for each request too far behind to draft this step."""
        segments = []
        for req in behind:
            start = req.speculation.draft_len
            segments.append((req, start, min(start + self.catch_up_tokens, req.kv_len), False))
        return segments

    def _draft_chains(
        self, reqs: list[Req], depths: list[int], behind: list[Req], kv: KVContext
    ) -> list[list[int]]:
        """Each request's drafted tokens (depths[i] of them)."""
        drafting = [i for i, depth in enumerate(depths) if depth > 0]
        # Each drafting request: from draft_len to its root, whose logits give the first draft.
        segments = [(reqs[i], reqs[i].speculation.draft_len, reqs[i].seq_len, True) for i in drafting]
        chains: list[list[int]] = [[] for _ in reqs]
        for i, first in zip(drafting, self._extend(segments + self._catch_up(behind), kv), strict=True):
            chains[i] += first
        for step in range(1, max(depths)):
            rows = [i for i in drafting if depths[i] > step]
            positions = [reqs[i].seq_len - 1 + step for i in rows]
            drafted = self._decode([reqs[i] for i in rows], positions, [chains[i][-1] for i in rows], kv)
            for i, token in zip(rows, drafted, strict=True):
                chains[i].append(token)
        for i in drafting:
            # The draft computed positions up to that of its last input, the second-to-last draft.
            reqs[i].speculation.draft_len = reqs[i].seq_len + depths[i] - 1
        return chains

    def _extend(self, segments: list[tuple[Req, int, int, bool]], kv: KVContext) -> list[list[int]]:
        """A draft extend of each (request, start, end, samples) over positions [start, end); one
        [token] per sampling segment, in order."""
        table = kv.req_to_token_pool.req_to_token
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        extend: list[ExtendSegment] = []
        sample_rows: list[int] = []
        offset = 0
        for req, start, end, samples in segments:
            row = table[req.req_pool_idx]
            input_ids += token_range(req, start, end)
            positions.append(torch.arange(start, end))
            slots.append(row[start:end])
            extend.append(ExtendSegment(offset, end - start, start, row[:start], row[:end]))
            offset += end - start
            if samples:
                sample_rows.append(offset - 1)
        device = kv.device
        out_cache_loc = torch.cat(slots)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.cat(positions).to(device),
            out_cache_loc=out_cache_loc,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
            extend=extend,
        )
        logits, _ = self.draft.forward(batch)
        self.valid[out_cache_loc] = True
        for req, _, end, _ in segments:
            req.speculation.draft_len = end
        return [[token] for token in self._greedy(logits)]

    def _decode(self, reqs: list[Req], positions: list[int], inputs: list[int], kv: KVContext) -> list[int]:
        """One draft decode step: request i computes token inputs[i] at positions[i]."""
        table = kv.req_to_token_pool.req_to_token
        pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=table.device)
        lens = torch.tensor(positions, dtype=torch.int64, device=table.device)
        out_cache_loc = table[pool_indices, lens]
        ids = [next(self._forward_ids) for _ in reqs]
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor(inputs, dtype=torch.int64, device=kv.device),
            positions=lens.to(kv.device),
            out_cache_loc=out_cache_loc.to(kv.device),
            sample_rows=torch.arange(len(reqs), device=kv.device),
            decode=build_decode_layout(table, pool_indices, lens + 1, request_ids=ids),
        )
        logits, _ = self.draft.forward(batch)
        self.valid[out_cache_loc] = True
        return self._greedy(logits)

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        """The draft's argmax among the target's tokens (the same on every tensor-parallel rank:
        the logits are gathered whole on each)."""
        tokens: list[int] = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        return tokens
