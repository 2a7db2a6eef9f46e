"""From a list of scheduled requests to a ForwardBatch: request slots, KV slots, tensors.

Every request in a batch computes `extend_len` tokens on top of the `kv_len` tokens whose KV it
already has. A new request starts from its matched prefix; a chunked request continues where its
last chunk ended; a decoding request computes its last output token (extend_len == 1). That one
rule covers prefill, chunked prefill, resumed requests and mixed prefill+decode batches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import cast

import torch

from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import PrefixCache
from radixserve.forward.batch import (
    ExtendSegment,
    ForwardBatch,
    ForwardMode,
    build_decode_layout,
)
from radixserve.forward.draft_tree import DraftTree
from radixserve.forward.host_tensors import list_tensor
from radixserve.scheduler.images import image_rows
from radixserve.scheduler.request import Req

# Admission serials (Req.admission), unique within the process.
_admissions = itertools.count()
# A decode step gives a request's window slots back once this many have left its window: one
# release per request every so many steps rather than every step.
WINDOW_RELEASE_BATCH = 16


class KVExhaustedError(RuntimeError):
    """The scheduler asked for more KV slots than free + evictable; its budget checks are wrong."""


@dataclass
class KVContext:
    req_to_token_pool: ReqToTokenPool
    allocator: KVSlotAllocator
    tree_cache: PrefixCache
    device: torch.device

    def available_with_eviction(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def make_room(self, num_slots: int) -> None:
        shortfall = num_slots - self.allocator.available_size()
        if shortfall > 0:
            self.tree_cache.evict(shortfall)

    def release_window(self, reqs: list[Req], at_least: int = 1) -> None:
        """With window slots (cache/swa_pool.py): each request's own positions that its next token
        no longer sees in a window (before kv_len - window + 1) give their window slots back, where
        at least `at_least` have piled up (a decode step releases in batches). With the radix
        cache a prompt keeps its window K/V: a later request may continue from any of its
        positions (a shared system prompt); the tokens a request generates give theirs back."""
        window = self.allocator.window
        if window is None:
            return
        table = self.req_to_token_pool.req_to_token
        keeps_prompts = not self.tree_cache.disabled
        rows: list[torch.Tensor] = []
        for req in reqs:
            prompt = len(req.origin_input_ids) if keeps_prompts else 0
            start = max(req.cached_len, req.window_released, prompt)
            end = req.kv_len - window + 1
            if req.req_pool_idx is not None and end - start >= at_least:
                rows.append(table[req.req_pool_idx, start:end])
                req.window_released = end
        if rows:
            self.allocator.release_window(torch.cat(rows))

    def slots_needed_for_decode(self, reqs: list[Req]) -> int:
        page = self.allocator.page_size
        if page == 1:
            return len(reqs)
        # Only a request whose last page is full needs a fresh page.
        return sum(page for r in reqs if r.kv_len % page == 0)


def token_range(req: Req, start: int, end: int) -> list[int]:
    """The request's tokens (prompt, then output) at positions [start, end)."""
    prompt = req.origin_input_ids
    if end <= len(prompt):
        return prompt[start:end]
    if start >= len(prompt):
        return req.output_ids[start - len(prompt) : end - len(prompt)]
    return prompt[start:] + req.output_ids[: end - len(prompt)]


def _assign_request_slot(req: Req, kv: KVContext) -> None:
    """First extend of a (re)admitted request: take a request slot and adopt its matched prefix."""
    idx = kv.req_to_token_pool.alloc()
    if idx is None:
        raise KVExhaustedError("no free request slot; admission must respect --max-running-requests")
    assert req.prefix_slots is not None and req.prefix_node is not None
    prefix_len = int(req.prefix_slots.shape[0])
    kv.req_to_token_pool.req_to_token[idx, :prefix_len] = req.prefix_slots
    req.req_pool_idx = idx
    req.admission = next(_admissions)
    req.cached_len = req.kv_len = req.window_released = prefix_len
    req.last_node = req.prefix_node
    # Count only tokens this request did not compute itself earlier (before a retraction or chunk).
    req.cached_tokens += max(0, prefix_len - req.computed_len)
    req.prefix_slots = None
    req.prefix_node = None


def _allocate_extend(reqs: list[Req], extend_lens: list[int], kv: KVContext) -> torch.Tensor:
    """KV slots for extend_lens new tokens per request after its kv_len (evicting if needed)."""
    table = kv.req_to_token_pool.req_to_token
    prefix_lens = [r.kv_len for r in reqs]
    last_locs = [int(table[r.req_pool_idx, r.kv_len - 1]) if r.kv_len else -1 for r in reqs]
    kv.make_room(sum(extend_lens) + len(reqs) * kv.allocator.page_size)
    out_cache_loc = kv.allocator.alloc_extend(prefix_lens, last_locs, extend_lens)
    if out_cache_loc is None:
        raise KVExhaustedError(
            f"cannot allocate {sum(extend_lens)} KV slots for an extend "
            f"(free {kv.allocator.available_size()}, evictable {kv.tree_cache.evictable_size()})"
        )
    return out_cache_loc


def build_extend_batch(reqs: list[Req], kv: KVContext) -> ForwardBatch:
    for req in reqs:
        if req.req_pool_idx is None:
            _assign_request_slot(req, kv)
    table = kv.req_to_token_pool.req_to_token
    prefix_lens = [r.kv_len for r in reqs]
    extend_lens = [r.extend_len for r in reqs]
    kv.release_window(reqs, at_least=WINDOW_RELEASE_BATCH)
    out_cache_loc = _allocate_extend(reqs, extend_lens, kv)

    input_ids: list[int] = []
    positions: list[torch.Tensor] = []
    segments: list[ExtendSegment] = []
    sample_rows: list[int] = []
    logprob_rows: list[int] = []
    hidden_rows: list[int] = []
    given_embeds: list[tuple[int, torch.Tensor]] = []
    offset = 0
    for req, start, n in zip(reqs, prefix_lens, extend_lens, strict=True):
        row = table[req.req_pool_idx]
        row[start : start + n] = out_cache_loc[offset : offset + n]
        input_ids.extend(token_range(req, start, start + n))
        if req.input_embeds is not None and start < len(req.origin_input_ids):
            given_embeds.append((offset, req.input_embeds[start : start + n]))
        given_embeds.extend((offset + row, vectors) for row, vectors in image_rows(req, start, n))
        positions.append(torch.arange(start, start + n))
        segments.append(
            ExtendSegment(
                q_start=offset,
                q_len=n,
                prefix_len=start,
                prefix_slots=row[:start],
                context_slots=row[: start + n],
            )
        )
        req.kv_len = start + n
        req.computed_len = max(req.computed_len, req.kv_len)
        if req.kv_len == req.seq_len:
            sample_rows.append(offset + n - 1)
        req.input_logprob_positions = None
        if req.needs_input_logprobs:
            # The logits at position p give the logprob of prompt token p + 1.
            first = max(start, req.input_logprob_next - 1)
            end = min(start + n, len(req.origin_input_ids) - 1)
            if first < end:
                req.input_logprob_positions = (first, end)
                logprob_rows.extend(range(offset + first - start, offset + end - start))
        req.prompt_hidden_positions = None
        if req.needs_prompt_hidden_states:
            # Every prompt position but the last (whose state comes with the first output token).
            first, end = (
                max(start, len(req.prompt_hidden_states)),
                min(start + n, len(req.origin_input_ids) - 1),
            )
            if first < end:
                req.prompt_hidden_positions = (first, end)
                hidden_rows.extend(range(offset + first - start, offset + end - start))
        offset += n

    device = kv.device
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=list_tensor(input_ids, torch.int64, device),
        positions=torch.cat(positions).to(device),
        out_cache_loc=out_cache_loc.to(device),
        sample_rows=list_tensor(sample_rows, torch.int64, device),
        logprob_rows=list_tensor(logprob_rows, torch.int64, device) if logprob_rows else None,
        hidden_rows=list_tensor(hidden_rows, torch.int64, device) if hidden_rows else None,
        extend=segments,
        input_embeds=given_embeds or None,
        lora_groups=lora_groups(reqs, extend_lens, device),
        window_map=kv.allocator.window_map,
    )


def build_decode_batch(reqs: list[Req], kv: KVContext) -> ForwardBatch:
    table = kv.req_to_token_pool.req_to_token
    seq_lens = [r.kv_len for r in reqs]
    # Every running request holds a request slot.
    pool_indices = list_tensor(cast("list[int]", [r.req_pool_idx for r in reqs]), torch.int64, table.device)
    lens = list_tensor(seq_lens, torch.int64, table.device)
    last_locs = table[pool_indices, (lens - 1).clamp(min=0)].tolist()
    kv.release_window(reqs, at_least=WINDOW_RELEASE_BATCH)
    kv.make_room(kv.slots_needed_for_decode(reqs))
    out_cache_loc = kv.allocator.alloc_decode(seq_lens, last_locs)
    if out_cache_loc is None:
        raise KVExhaustedError("cannot allocate KV slots for a decode step; retraction should have made room")
    table[pool_indices, lens] = out_cache_loc
    for req in reqs:
        req.kv_len += 1
        # computed_len = max(computed_len, kv_len), without a call per request per step.
        if req.kv_len > req.computed_len:
            req.computed_len = req.kv_len

    device = kv.device
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=list_tensor([r.output_ids[-1] for r in reqs], torch.int64, device),
        positions=lens.to(device),
        out_cache_loc=out_cache_loc.to(device),
        sample_rows=torch.arange(len(reqs), device=device),
        decode=build_decode_layout(table, pool_indices, lens + 1, request_ids=[r.admission for r in reqs]),
        lora_groups=lora_groups(reqs, [1] * len(reqs), device),
        window_map=kv.allocator.window_map,
    )


def allocate_verify_slots(reqs: list[Req], sizes: list[int], kv: KVContext) -> torch.Tensor:
    """KV slots for a verify step, sizes[i] for request i at positions kv_len.., entered in each
    request's row (kv_len is left alone: commit decides what is kept)."""
    table = kv.req_to_token_pool.req_to_token
    out_cache_loc = _allocate_extend(reqs, sizes, kv)
    offset = 0
    for req, n in zip(reqs, sizes, strict=True):
        table[req.req_pool_idx, req.kv_len : req.kv_len + n] = out_cache_loc[offset : offset + n]
        offset += n
    return out_cache_loc


def build_verify_batch(
    reqs: list[Req], trees: list[DraftTree], kv: KVContext, out_cache_loc: torch.Tensor | None = None
) -> ForwardBatch:
    """A VERIFY step (speculative decoding): each decoding request computes its draft tree in one
    forward (the root, its last sampled token whose K/V is not in the pool yet, then the proposed
    tokens) and every node is sampled, so that node i's logits check its children.

    Node i's K/V goes to the slot of position kv_len + i in the request's row, though its position
    is kv_len + its depth: which nodes are accepted, and so which K/V the request keeps (moved to
    the positions of the accepted path), is decided after the forward (commit_verified). kv_len
    is left alone here. out_cache_loc: the slots allocate_verify_slots took for the trees already
    (a draft model wrote its own K/V there first), else they are taken now."""
    if not reqs or len(trees) != len(reqs):
        raise ValueError("one draft tree per request")
    table = kv.req_to_token_pool.req_to_token
    prefix_lens = [r.kv_len for r in reqs]
    sizes = [len(t) for t in trees]
    if out_cache_loc is None:
        out_cache_loc = allocate_verify_slots(reqs, sizes, kv)
    elif int(out_cache_loc.shape[0]) != sum(sizes):
        raise ValueError(f"{int(out_cache_loc.shape[0])} slots taken for trees of {sum(sizes)} nodes")
    input_ids: list[int] = []
    positions: list[int] = []
    segments: list[ExtendSegment] = []
    offset = 0
    for req, start, tree in zip(reqs, prefix_lens, trees, strict=True):
        if tree.tokens[0] != req.output_ids[-1]:
            raise ValueError(f"request {req.rid}'s draft tree is not rooted at its last token")
        n = len(tree)
        row = table[req.req_pool_idx]
        input_ids += tree.tokens
        positions += [start + d for d in tree.depths]
        segments.append(ExtendSegment(offset, n, start, row[:start], row[: start + n]))
        offset += n
    device = kv.device
    masks = [None if t.is_chain else t.visibility() for t in trees]
    return ForwardBatch(
        mode=ForwardMode.VERIFY,
        input_ids=list_tensor(input_ids, torch.int64, device),
        positions=list_tensor(positions, torch.int64, device),
        out_cache_loc=out_cache_loc.to(device),
        sample_rows=torch.arange(offset, device=device),
        extend=segments,
        verify_masks=masks if any(m is not None for m in masks) else None,
        lora_groups=lora_groups(reqs, sizes, device),
    )


def lora_groups(
    reqs: list[Req], row_counts: list[int], device: torch.device
) -> list[tuple[int, torch.Tensor]] | None:
    """Each LoRA adapter slot the requests use and the rows (row_counts[i] for request i, in
    order) of those using it; None when none uses one."""
    slots = [r.lora_slot for r in reqs]
    if slots.count(None) == len(slots):
        return None  # the common case, and always so without --enable-lora: no per-row work
    rows: dict[int, list[int]] = {}
    offset = 0
    for req, n in zip(reqs, row_counts, strict=True):
        if req.lora_slot is not None:
            rows.setdefault(req.lora_slot, []).extend(range(offset, offset + n))
        offset += n
    if not rows:
        return None
    return [(slot, list_tensor(r, torch.int64, device)) for slot, r in sorted(rows.items())]


def truncate_kv(req: Req, keep: int, allocated_end: int, kv: KVContext) -> None:
    """A request keeps the K/V of its first `keep` positions; the slots of positions [keep,
    allocated_end) that it took for a verify step go back, in whole pages (a page holding a kept
    position stays: later tokens of the request fill it)."""
    page = kv.allocator.page_size
    first_free = -(-keep // page) * page
    if first_free < allocated_end:
        row = kv.req_to_token_pool.req_to_token[req.req_pool_idx]
        kv.allocator.free(row[first_free:allocated_end])
    req.kv_len = keep


def reserve_prompt_kv(req: Req, kv: KVContext, headroom: int = 0) -> bool:
    """A request slot and KV slots for the whole prompt, with no cached prefix, for K/V computed
    elsewhere (a decode server under disaggregation), leaving `headroom` slots. False, and nothing
    taken, when either is short. The request owns the slots with kv_len 0 until the K/V is written."""
    length = len(req.origin_input_ids)
    page = kv.allocator.page_size
    if kv.available_with_eviction() < length + page + headroom:
        return False
    idx = kv.req_to_token_pool.alloc()
    if idx is None:
        return False
    kv.make_room(length + page)
    slots = kv.allocator.alloc_extend([0], [-1], [length])
    if slots is None:
        kv.req_to_token_pool.free(idx)
        return False
    kv.req_to_token_pool.req_to_token[idx, :length] = slots
    req.req_pool_idx = idx
    req.admission = next(_admissions)
    req.cached_len = req.kv_len = 0
    return True


def release_unfilled_prompt_kv(req: Req, kv: KVContext) -> None:
    """Gives back what reserve_prompt_kv took when the K/V never came (nothing goes to the cache)."""
    if req.req_pool_idx is None:
        return
    row = kv.req_to_token_pool.req_to_token[req.req_pool_idx]
    kv.allocator.free(row[: len(req.origin_input_ids)])
    kv.req_to_token_pool.free(req.req_pool_idx)
    req.req_pool_idx = None
    req.cached_len = req.kv_len = 0
