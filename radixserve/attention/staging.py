"""Decode staging: contiguous copies of the running requests' K/V, kept from one decode step to the next.

The KV pool is paged: a request's context lies in scattered slots, so batched decode attention
first gathers each bucket's K/V into a dense [size, len, Hkv, D] block, every layer, every step.
That gather reads and writes as many bytes as attention itself reads (a measurable share of a CPU
decode step: docs/architecture.md). A bucket whose requests stay the same from one
step to the next only gains one token per request, so its dense block is kept between steps
(staged) and receives just the new token's K/V; attention reads it in place.

The pool stays the source of truth (the radix cache owns its slots). A staged block is refilled
from the pool whenever its bucket is not exactly the block's requests one token further on: a
request joined or left, the shared prefix changed, or a request's length did not advance by exactly
one (it took part in a mixed prefill). Blocks are keyed by each request's admission serial, which
is new after a retraction, the only event that changes the slots of a running request's context;
so a prefill of other requests in between leaves the blocks valid. The staged bytes come on top of
the pool, so they are capped (--decode-staging-tokens); buckets beyond the cap gather as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixserve.attention.decode_buckets import DecodeBucket
from radixserve.layers.packed_weights import round_up_to_eighth

# A refilled block leaves room for this share of its length (at least MIN_HEADROOM tokens) of
# further decode steps before it must be refilled at a larger size.
HEADROOM_FRACTION = 0.25
MIN_HEADROOM = 32


@dataclass
class StagedBucket:
    """One bucket's dense K/V for every layer: row b holds request b's tokens at [0, own_len_b)."""

    keys: torch.Tensor  # [layers, size * capacity, Hkv, D]
    values: torch.Tensor
    shared_keys: torch.Tensor | None  # [layers, shared_len, Hkv, D]: the bucket's shared prefix
    shared_values: torch.Tensor | None
    capacity: int  # tokens per row
    own_lens: torch.Tensor  # [size] tokens per row after this step
    # This step: either refill from these pool slots ([size * capacity], padded with real slots) ...
    refill_slots: torch.Tensor | None
    # ... or write only each row's new token, at these flat rows of `keys` ([size]).
    append_rows: torch.Tensor | None
    # The flat allocations the tensors above are views of, for reuse once the block is dropped.
    buffers: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        shared = 0 if self.shared_keys is None else int(self.shared_keys.shape[1])
        return int(self.own_lens.shape[0]) * self.capacity + shared


class DecodeStaging:
    """Owns the staged blocks of the current decode batch (see the module docstring)."""

    def __init__(
        self,
        max_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.max_tokens = max_tokens
        self.num_layers = num_layers
        self.kv_shape = (num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        # Keyed by the bucket's request ids (in row order) and its shared prefix length.
        self._blocks: dict[tuple[tuple[int, ...], int], StagedBucket] = {}
        # Buffers of blocks that no bucket continues, for refills to reuse: fresh memory costs page
        # faults on first touch, which costs more than filling reused memory.
        self._spares: list[torch.Tensor] = []
        self.refills = 0
        self.appends = 0

    @property
    def staged_tokens(self) -> int:
        return sum(block.num_tokens for block in self._blocks.values())

    def release(self) -> None:
        """Frees every block and spare buffer (when idle or when the KV cache is released)."""
        self._blocks, self._spares = {}, []

    def prepare(self, buckets: list[DecodeBucket], request_ids: list[int]) -> list[StagedBucket | None]:
        """Each bucket's staged block for this decode step (None: gathered from the pool), reusing
        the previous step's block where the bucket is the same requests one token further on."""
        keys = [self._key(request_ids, bucket) for bucket in buckets]
        staged: list[StagedBucket | None] = [None] * len(buckets)
        kept: dict[tuple[tuple[int, ...], int], StagedBucket] = {}
        for index, (key, bucket) in enumerate(zip(keys, buckets, strict=True)):
            block = self._blocks.get(key)
            if block is not None and self._can_append(block, bucket):
                self._advance(block, bucket)
                kept[key] = staged[index] = block
        self._spares += [t for key, b in self._blocks.items() if key not in kept for t in b.buffers]
        self._blocks = kept
        budget = self.max_tokens - self.staged_tokens
        for index, (key, bucket) in enumerate(zip(keys, buckets, strict=True)):
            if key in kept:
                continue
            shared_len = 0 if bucket.shared_slots is None else int(bucket.shared_slots.shape[0])
            capacity = bucket.max_len + max(MIN_HEADROOM, int(bucket.max_len * HEADROOM_FRACTION))
            if bucket.size * capacity + shared_len > budget:
                continue
            block = self._refill(bucket, capacity, shared_len)
            budget -= block.num_tokens
            kept[key] = staged[index] = block
        self._spares = []
        return staged

    @staticmethod
    def _key(ids: list[int], bucket: DecodeBucket) -> tuple[tuple[int, ...], int]:
        rows = ids if bucket.rows is None else [ids[i] for i in bucket.rows.tolist()]
        shared_len = 0 if bucket.shared_slots is None else int(bucket.shared_slots.shape[0])
        return tuple(rows), shared_len

    def _can_append(self, block: StagedBucket, bucket: DecodeBucket) -> bool:
        return bucket.max_len <= block.capacity and torch.equal(block.own_lens + 1, bucket.own_lens)

    def _advance(self, block: StagedBucket, bucket: DecodeBucket) -> None:
        block.own_lens = bucket.own_lens
        rows = torch.arange(bucket.size, device=self.device) * block.capacity
        block.append_rows = rows + bucket.own_lens - 1
        block.refill_slots = None
        self.appends += 1

    def _buffer(self, elements: int) -> torch.Tensor:
        """A flat buffer of at least this many elements: the smallest spare that holds it, else fresh
        memory (the spares, too small for this one, are let go first). Fresh sizes are rounded up to
        eight per power of two, so that a bucket a few tokens longer than before fits its old buffers."""
        fitting = [i for i, t in enumerate(self._spares) if t.numel() >= elements]
        if fitting:
            return self._spares.pop(min(fitting, key=lambda i: self._spares[i].numel()))
        self._spares = []
        return torch.empty(round_up_to_eighth(elements), dtype=self.dtype, device=self.device)

    def _refill(self, bucket: DecodeBucket, capacity: int, shared_len: int) -> StagedBucket:
        slots = bucket.kv_slots.view(bucket.size, bucket.max_len)
        # Rows are padded past their length with their own first slot: real data, masked out.
        padding = slots[:, :1].expand(bucket.size, capacity - bucket.max_len)
        buffers: list[torch.Tensor] = []

        def carve(tokens: int) -> torch.Tensor:
            shape = (self.num_layers, tokens, *self.kv_shape)
            buffers.append(self._buffer(math.prod(shape)))
            return buffers[-1][: math.prod(shape)].view(shape)

        self.refills += 1
        return StagedBucket(
            keys=carve(bucket.size * capacity),
            values=carve(bucket.size * capacity),
            shared_keys=carve(shared_len) if shared_len else None,
            shared_values=carve(shared_len) if shared_len else None,
            capacity=capacity,
            own_lens=bucket.own_lens,
            refill_slots=torch.cat((slots, padding), dim=1).reshape(-1),
            append_rows=None,
            buffers=buffers,
        )


# The shared prefix's staged K/V (all layers) may take at most this much memory; a longer prefix
# is gathered from the pool every step instead.
MAX_PREFIX_STAGING_BYTES = 64 * 2**20


@dataclass
class StagedPrefix:
    """K/V of the prefix every request of a decode batch shares, contiguous, for all layers. Each
    layer is gathered from the pool on its first use and reused while the prefix stays shared."""

    slots: torch.Tensor  # [P]
    keys: torch.Tensor  # [layers, P, Hkv, D]
    values: torch.Tensor
    filled: list[bool]
    # The requests (admission serials) of the last decode step that used this block.
    holders: set[int]

    def layer_kv(
        self, layer_id: int, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's [P, Hkv, D] keys and values."""
        if not self.filled[layer_id]:
            torch.index_select(k_cache, 0, self.slots, out=self.keys[layer_id])
            torch.index_select(v_cache, 0, self.slots, out=self.values[layer_id])
            self.filled[layer_id] = True
        return self.keys[layer_id], self.values[layer_id]


class PrefixStaging:
    """Keeps the shared prefix's K/V between decode steps for the native decode kernel's cascade
    (which reads everything else in place from the pool).

    A block stays valid while some request that held the prefix in the previous decode step is
    still running under the same admission serial: its lock on those slots in the radix cache
    keeps their K/V unchanged. Otherwise the slots may have been freed and rewritten in between."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ):
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        token_bytes = 2 * math.prod(self.shape) * dtype.itemsize  # 0 for an encoder: no K/V kept
        self.max_tokens = MAX_PREFIX_STAGING_BYTES // token_bytes if token_bytes else 0
        self._block: StagedPrefix | None = None

    def release(self) -> None:
        self._block = None

    def prepare(self, slots: torch.Tensor | None, request_ids: list[int]) -> StagedPrefix | None:
        """The block for this decode step's shared prefix (None: none, or too long to keep)."""
        ids = set(request_ids)
        if slots is None or len(slots) > self.max_tokens:
            self._block = None
            return None
        block = self._block
        if block is None or not (block.holders & ids and torch.equal(block.slots, slots)):
            layers, heads, dim = self.shape
            kv = torch.empty((2, layers, len(slots), heads, dim), dtype=self.dtype, device=self.device)
            block = StagedPrefix(slots.clone(), kv[0], kv[1], [False] * layers, ids)
        block.holders = ids
        self._block = block
        return block


def bucket_kv(
    bucket: DecodeBucket,
    block: StagedBucket | None,
    layer_id: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucket's own (non-shared) K/V for this layer, [size, Hkv, max_len, D] each.

    new_k/new_v: this step's K/V of the bucket's rows ([size, Hkv, D]), already in the pool."""
    size, max_len = bucket.size, bucket.max_len
    if block is None:
        shape = (size, max_len, *k_cache.shape[1:])
        keys = k_cache.index_select(0, bucket.kv_slots).view(shape)
        values = v_cache.index_select(0, bucket.kv_slots).view(shape)
        return keys.transpose(1, 2), values.transpose(1, 2)
    keys, values = block.keys[layer_id], block.values[layer_id]
    if block.refill_slots is not None:
        torch.index_select(k_cache, 0, block.refill_slots, out=keys)
        torch.index_select(v_cache, 0, block.refill_slots, out=values)
    else:
        assert block.append_rows is not None
        keys.index_copy_(0, block.append_rows, new_k.to(keys.dtype))
        values.index_copy_(0, block.append_rows, new_v.to(values.dtype))
    shape = (size, block.capacity, *k_cache.shape[1:])
    return (
        keys.view(shape)[:, :max_len].transpose(1, 2),
        values.view(shape)[:, :max_len].transpose(1, 2),
    )


def shared_kv(
    bucket: DecodeBucket,
    block: StagedBucket | None,
    layer_id: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucket's shared prefix K/V for this layer, [1, Hkv, shared_len, D] each."""
    assert bucket.shared_slots is not None
    if block is None or block.shared_keys is None or block.shared_values is None:
        keys = k_cache.index_select(0, bucket.shared_slots)
        values = v_cache.index_select(0, bucket.shared_slots)
    else:
        keys, values = block.shared_keys[layer_id], block.shared_values[layer_id]
        if block.refill_slots is not None:
            torch.index_select(k_cache, 0, bucket.shared_slots, out=keys)
            torch.index_select(v_cache, 0, bucket.shared_slots, out=values)
    return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
