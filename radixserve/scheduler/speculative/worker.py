"""Speculative decoding inside the scheduler: draft, verify in one forward, keep what holds.

Speculator holds what both algorithms share: verify, commit and record below, the cost model
(cost.py) and the hooks the scheduler calls. A subclass plans the steps, drafting its own way:
NgramSpeculator here from the shared n-gram index (ngram.py), DraftModelSpeculator
(draft_model.py) with a smaller model.

A decode step of the running batch becomes a VERIFY step when some request has a draft: each
request's draft tree (scheduler/speculative/ngram.py; a root-only tree for a request with no draft
or one that cannot speculate) is computed in one forward, every node sampled (verify.py), and each
request emits its accepted drafts plus one token of the target's own. Then (commit):

- the K/V of the accepted path moves to the positions the path's tokens now have (a chain's is
  in place already), and the slots of everything else the step took go back to the allocator at
  once, so rejected drafts never reach the radix cache and nothing is counted twice;
- a request that finished partway along the path (EOS, a stop string, max_new_tokens) keeps only
  the K/V and logprobs of the tokens it emitted.

Requests with a grammar, a custom logit processor or hidden states take part with a root-only
tree, sampled by the normal path (next_tokens.py), so they decode exactly as without speculation.

Adaptive (cost.py): a draft token is proposed only when its estimated chance of being emitted
beats what verifying it costs on this machine, measured from the forwards themselves; so a
request whose drafts keep failing, or a batch too large for drafts to pay, stops drafting, and
workloads with nothing to copy pay for few verify steps. A step where no request has a draft is a
plain decode step (the fast fused path). --disable-speculative-adaptive drafts whatever the index
offers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.config.server_args import ServerArgs
from radixserve.forward.draft_tree import DraftTree
from radixserve.scheduler.batch import KVContext, truncate_kv
from radixserve.scheduler.logprobs import position_logprobs
from radixserve.scheduler.next_tokens import GrammarMask, Sampler, pick_next_tokens
from radixserve.scheduler.request import Req
from radixserve.scheduler.speculative.cost import StepCost
from radixserve.scheduler.speculative.ngram import NgramConfig, NgramIndex
from radixserve.scheduler.speculative.verify import Verified, draw_tree_tokens
from radixserve.scheduler.stats import SchedulerStats


@dataclass
class VerifyPlan:
    """One verify step: the running requests' trees, and which requests draw through the tree
    sampler (the others, with root-only trees, through the normal one)."""

    trees: list[DraftTree]
    speculating: list[bool]
    # Each request's kv_len before the step: the tree's node i took the slot of position start + i.
    starts: list[int]
    # The slots the trees took already (allocate_verify_slots), when drafting needed them first.
    out_cache_loc: torch.Tensor | None = None


def _text_from(req: Req, start: int) -> list[int]:
    """The request's tokens (prompt, then output) from position start on, without copying the rest."""
    prompt, output = req.origin_input_ids, req.output_ids
    start = max(0, start)
    if start >= len(prompt):
        return output[start - len(prompt) :]
    return prompt[start:] + output


def speculates(req: Req) -> bool:
    """Whether a request's tokens may come from the tree sampler (else it decodes normally)."""
    return req.grammar is None and req.logit_processor is None and not req.return_hidden_states


def agree_alone(values: list[int]) -> list[int]:
    return values


class Speculator(ABC):
    """What the scheduler calls: plan before a decode step; verify, commit and record after a
    verify step's forward; written, observe, observe_forward, reset and idle along the way."""

    def __init__(
        self,
        args: ServerArgs,
        context_len: int,
        row_len: int,
        agree: Callable[[list[int]], list[int]] = agree_alone,
    ):
        """agree: rank 0's values on every tensor-parallel rank (scheduler/rank_sync.py). The
        cost model's timings differ between ranks, and their plans must not."""
        self.context_len = context_len
        self.row_len = row_len
        self.adaptive = not args.disable_speculative_adaptive
        self.cost = StepCost()
        self.agree = agree

    @abstractmethod
    def plan(self, reqs: list[Req], kv: KVContext) -> VerifyPlan | None:
        """The verify step for the running requests, or None for a plain decode step: each
        algorithm drafts its own way."""

    def observe_forward(self, tokens: int, seconds: float, plain: bool) -> None:
        """A decode (plain) or verify step of `tokens` tokens took `seconds`."""
        (nanoseconds,) = self.agree([int(seconds * 1e9)])
        self.cost.observe(tokens, nanoseconds / 1e9, plain)

    def written(self, slots: torch.Tensor) -> None:
        """The target's K/V at these slots were written without the draft: by a forward other than
        a verify step's, or by a cache tier loading a prefix back."""
        return None  # a hook: nothing to do unless the algorithm keeps state for it

    def observe(self, req: Req) -> None:
        """The request's tokens so far (at each step's plan, and when it finishes)."""
        return None  # a hook: nothing to do unless the algorithm keeps state for it

    def reset(self) -> None:
        """/flush_cache: whatever the speculator keeps of past text goes."""
        return None  # a hook: nothing to do unless the algorithm keeps state for it

    def idle(self) -> None:
        """Nothing runs now."""
        return None  # a hook: nothing to do unless the algorithm keeps state for it

    def release_memory(self, tags: set[str]) -> None:
        """/release_memory_occupation: the target's memory of these tags is released."""
        return None  # a hook: nothing to do unless the algorithm keeps state for it

    def resume_memory(self, tags: set[str]) -> None:
        """/resume_memory_occupation: and back."""
        return None  # a hook: nothing to do unless the algorithm keeps state for it

    # ------------------------------------------------------------------ after the forward

    def verify(
        self,
        reqs: list[Req],
        plan: VerifyPlan,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        vocab_size: int,
        sample: Sampler,
        grammar_mask: GrammarMask,
    ) -> list[Verified]:
        """Each request's tokens for this step (logits, hidden: one row per tree node)."""
        offsets, offset = [], 0
        for tree in plan.trees:
            offsets.append(offset)
            offset += len(tree)
        results: list[Verified | None] = [None] * len(reqs)
        tree_side = [i for i, able in enumerate(plan.speculating) if able]
        plain_side = [i for i, able in enumerate(plan.speculating) if not able]
        if tree_side:
            rows = torch.cat([torch.arange(offsets[i], offsets[i] + len(plan.trees[i])) for i in tree_side])
            drawn = draw_tree_tokens(
                [reqs[i] for i in tree_side],
                [plan.trees[i] for i in tree_side],
                logits.index_select(0, rows.to(logits.device)),
                vocab_size,
                sample,
            )
            for i, found in zip(tree_side, drawn, strict=True):
                results[i] = found
        if plain_side:
            rows = torch.tensor([offsets[i] for i in plain_side], device=logits.device)
            plain_reqs = [reqs[i] for i in plain_side]
            ids = pick_next_tokens(
                plain_reqs,
                logits.index_select(0, rows),
                hidden.index_select(0, rows),
                vocab_size,
                sample,
                grammar_mask,
            )
            for i, token in zip(plain_side, ids, strict=True):
                results[i] = Verified([token], [0], 0)
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def commit(
        self,
        reqs: list[Req],
        plan: VerifyPlan,
        verified: list[Verified],
        kv: KVContext,
        move_kv: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> None:
        """Moves each accepted path's K/V to the positions its tokens now have, sets kv_len to
        cover the root and the accepted drafts, and frees the slots of the rest."""
        table = kv.req_to_token_pool.req_to_token
        sources: list[int] = []
        targets: list[int] = []
        for req, start, found in zip(reqs, plan.starts, verified, strict=True):
            row = table[req.req_pool_idx]
            # Accepted draft j (1-based along the path) was node nodes[j]; it belongs at start + j.
            for j, node in enumerate(found.nodes[1:], start=1):
                if node != j:
                    sources.append(int(row[start + node]))
                    targets.append(int(row[start + j]))
        if sources:
            # One batched copy: every source is read before any target is written.
            move_kv(torch.tensor(sources, dtype=torch.int64), torch.tensor(targets, dtype=torch.int64))
        for req, tree, start, found in zip(reqs, plan.trees, plan.starts, verified, strict=True):
            truncate_kv(req, start + len(found.tokens), start + len(tree), kv)

    def record(
        self,
        reqs: list[Req],
        plan: VerifyPlan,
        verified: list[Verified],
        kept: list[int],
        logits: torch.Tensor,
        kv: KVContext,
        stats: SchedulerStats,
    ) -> None:
        """After the tokens were appended (kept[i] of request i's were, fewer when it finished
        partway): logprobs of the kept tokens, K/V of the rest dropped, acceptance counted."""
        offset = 0
        logprob_rows, logprob_tokens, owners = [], [], []
        for req, tree, start, found, count, able in zip(
            reqs, plan.trees, plan.starts, verified, kept, plan.speculating, strict=True
        ):
            if able:
                if count < len(found.tokens):
                    # Finished partway: the K/V of the tokens it did not emit goes too.
                    truncate_kv(req, start + count, start + len(found.tokens), kv)
                if req.logprobs is not None and count:
                    logprob_rows += [offset + node for node in found.nodes[:count]]
                    logprob_tokens += found.tokens[:count]
                    owners += [req] * count
                if found.drafted:
                    stats.record_verify(found.drafted, found.accepted, len(found.tokens))
                    req.speculation.record(found.accepted, found.rejected)
            offset += len(tree)
        if owners:
            rows = torch.tensor(logprob_rows, dtype=torch.int64, device=logits.device)
            for req, entry in zip(
                owners, position_logprobs(logits.index_select(0, rows), logprob_tokens, owners), strict=True
            ):
                assert req.logprobs is not None
                req.logprobs.extend(entry)
        stats.record_extra_tokens(sum(kept) - len(reqs))


class NgramSpeculator(Speculator):
    def __init__(
        self,
        args: ServerArgs,
        context_len: int,
        row_len: int,
        agree: Callable[[list[int]], list[int]] = agree_alone,
    ):
        super().__init__(args, context_len, row_len, agree)
        self.index = NgramIndex(
            NgramConfig(
                min_window=args.speculative_ngram_min_match_window_size,
                max_window=args.speculative_ngram_max_match_window_size,
                min_breadth=args.speculative_ngram_min_bfs_breadth,
                max_breadth=args.speculative_ngram_max_bfs_breadth,
                match_type=args.speculative_ngram_match_type,
                max_depth=args.speculative_ngram_branch_length,
                capacity=args.speculative_ngram_capacity,
            )
        )
        self.num_draft_tokens = args.speculative_num_draft_tokens
        self.max_window = args.speculative_ngram_max_match_window_size

    def reset(self) -> None:
        """Forgets every n-gram (/flush_cache): later drafts come from later text only."""
        self.index = NgramIndex(self.index.config)

    def plan(self, reqs: list[Req], kv: KVContext) -> VerifyPlan | None:
        """The verify step for the running requests, or None for a plain decode step (no request
        has a draft, or the KV pool cannot hold the drafts without a retraction)."""
        trees, speculating = [], []
        if self.adaptive and self.cost.needs_plain_step:
            return None  # keeps the cost fit informed about plain decode steps
        min_reach = self.cost.reach_threshold(len(reqs)) if self.adaptive else 0.0
        expected_extra = 0.0  # the drafts' summed chance of being emitted
        for req in reqs:
            self.observe(req)
            req.speculation.settle_shadow(req.output_ids)
            tree = DraftTree([req.output_ids[-1]], [-1])
            able = speculates(req)
            if able:
                # Emitting depth + 1 tokens must stay within max_new_tokens and the context.
                depth = min(req.remaining_new_tokens, self.context_len - req.seq_len) - 1
                budget = min(self.num_draft_tokens, self.row_len - req.kv_len)
                odds = req.speculation.accept_odds if self.adaptive else 1.0
                context = _text_from(req, req.seq_len - self.max_window)
                tree = self.index.propose(context, budget, depth, odds, min_reach)
                if len(tree) == 1:
                    req.speculation.sit_out()
                expected_extra += sum(odds**d for d in tree.depths[1:])
            trees.append(tree)
            speculating.append(able)
        drafts = sum(len(t) - 1 for t in trees)
        if drafts == 0:
            return None
        page = kv.allocator.page_size
        if (self.adaptive and not self.cost.worth_verifying(len(reqs), drafts, expected_extra)) or (
            kv.available_with_eviction() < sum(len(t) for t in trees) + len(reqs) * page
        ):
            # A plain step instead; the token it emits still tells each request's odds.
            for req, tree in zip(reqs, trees, strict=True):
                if len(tree) > 1:
                    req.speculation.offer_shadow(frozenset(tree.children()[0]), len(req.output_ids))
            return None
        return VerifyPlan(trees, speculating, [r.kv_len for r in reqs])

    def observe(self, req: Req) -> None:
        """Adds the request's tokens not yet in the shared index (its prompt at its first decode
        step, then each step's new output, and the rest when it finishes)."""
        state = req.speculation
        if state.indexed < req.seq_len:
            # Windows ending at the new tokens reach back at most max_window tokens.
            start = max(0, state.indexed - self.max_window)
            self.index.add(_text_from(req, start), state.indexed - start)
            state.indexed = req.seq_len
