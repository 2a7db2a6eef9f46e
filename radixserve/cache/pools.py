"""Memory pools backing the KV cache.

Three layers, mirroring how attention finds a token's KV:

* ``ReqToTokenPool`` maps (request slot, token position) -> KV slot index.
* ``KVSlotAllocator`` hands out KV slot indices, in pages of ``page_size``.
* ``KVCachePool`` holds the actual per-layer K/V tensors indexed by KV slot.

The allocator and the KV buffers are deliberately separate so that the radix
cache and the scheduler can reason about slot ownership without touching
tensors that live on the accelerator.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["KVCachePool", "KVSlotAllocator", "ReqToTokenPool", "zeros_on_demand"]


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, except that on a CPU the memory comes from an anonymous mapping: the OS's zero
    pages, taken as they are written. A KV pool sized for a long context then holds memory for the
    tokens it has stored, not for its capacity."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive.
    return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8).view(dtype).view(shape)


class ReqToTokenPool:
    """Request slot x position -> KV slot table."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"size ({size}) and max_context_len ({max_context_len}) must be positive")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # int64 so rows can be used directly as an index into the KV buffers.
        self.req_to_token = zeros_on_demand((size, max_context_len), torch.int64, self.device)
        self._free: list[int] = []
        self._is_free: list[bool] = []
        self.clear()

    def alloc(self) -> int | None:
        if not self._free:
            return None
        idx = self._free.pop()
        self._is_free[idx] = False
        return idx

    def free(self, idx: int) -> None:
        if not 0 <= idx < self.size:
            raise ValueError(f"req pool index {idx} out of range [0, {self.size})")
        if self._is_free[idx]:
            raise ValueError(f"double free of req pool index {idx}")
        self._is_free[idx] = True
        self._free.append(idx)

    def available_size(self) -> int:
        return len(self._free)

    def clear(self) -> None:
        # Reversed so that pop() hands out 0, 1, 2, ... which keeps tests and logs readable.
        self._free = list(range(self.size - 1, -1, -1))
        self._is_free = [True] * self.size


class KVCachePool:
    """Per-layer K and V buffers, each ``[num_slots, num_kv_heads, head_dim]``.

    window_layers: layers whose K/V are held in window slots (cache/swa_pool.py) rather than in the
    slots every layer shares; their buffers have one more row, where released positions point."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        window_layers: frozenset[int] = frozenset(),
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.window_layers = window_layers
        self.k_buffers: list[torch.Tensor] = []
        self.v_buffers: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        def shape(layer: int) -> tuple[int, int, int]:
            rows = self.num_slots + (1 if layer in self.window_layers else 0)
            return (rows, self.num_kv_heads, self.head_dim)

        layers = range(self.num_layers)
        self.k_buffers = [zeros_on_demand(shape(i), self.dtype, self.device) for i in layers]
        self.v_buffers = [zeros_on_demand(shape(i), self.dtype, self.device) for i in layers]

    def _check_shared_slots(self, what: str) -> None:
        if self.window_layers:
            raise RuntimeError(f"{what} reads every layer by shared slots; window slots have their own")

    def release(self) -> None:
        """Frees the buffers (their contents are lost); allocate() brings them back."""
        self.k_buffers, self.v_buffers = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # index_copy_ is several times faster than advanced-index assignment on CPU.
        self.k_buffers[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer_id].index_copy_(0, loc, v.to(self.dtype))

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V at slots src copied to slots dst (src read before anything is written)."""
        self._check_shared_slots("move")
        for buffers in (self.k_buffers, self.v_buffers):
            for buffer in buffers:
                buffer.index_copy_(0, dst, buffer.index_select(0, src))

    def read_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's K and V at slots, as one tensor [num_layers, 2, len(slots), heads, head_dim]
        (what a lower cache tier keeps of them)."""
        self._check_shared_slots("read_slots")
        return torch.stack(
            [
                torch.stack((k.index_select(0, slots), v.index_select(0, slots)))
                for k, v in zip(self.k_buffers, self.v_buffers, strict=True)
            ]
        )

    def write_slots(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """The inverse of read_slots: kv [num_layers, 2, len(slots), heads, head_dim] into slots."""
        self._check_shared_slots("write_slots")
        for layer, (k, v) in enumerate(zip(self.k_buffers, self.v_buffers, strict=True)):
            k.index_copy_(0, slots, kv[layer, 0].to(self.dtype))
            v.index_copy_(0, slots, kv[layer, 1].to(self.dtype))

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class KVSlotAllocator:
    """Free list of KV slots, handed out in whole pages.

    Paging invariant: the slot holding token position ``p`` of a request satisfies
    ``slot % page_size == p % page_size``. Paged attention kernels rely on this to
    address a request's KV as a list of pages, and the radix cache relies on it so
    that every tree node (whose boundaries are page aligned) owns whole pages.
    """

    # The sliding window whose layers hold their K/V in window slots (cache/swa_pool.py); None here:
    # every layer reads a token's K/V at its one slot, and the window hooks below do nothing.
    window: int | None = None
    # slot -> window slot (cache/swa_pool.py), what attention translates the slots by; None here.
    window_map: torch.Tensor | None = None

    def __init__(self, num_slots: int, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.device = torch.device(device)
        self.num_pages = num_slots // page_size
        if self.num_pages <= 0:
            raise ValueError(f"num_slots ({num_slots}) must hold at least one page of {page_size}")
        self.total_slots = self.num_pages * page_size
        self._free_pages = torch.empty(0, dtype=torch.int64, device=self.device)
        self._is_free = torch.empty(0, dtype=torch.bool, device=self.device)
        self._released: list[torch.Tensor] = []
        self._num_released = 0
        self.clear()

    def clear(self) -> None:
        self._free_pages = torch.arange(self.num_pages, dtype=torch.int64, device=self.device)
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool, device=self.device)
        # Freed pages are parked here and merged only when the main list runs short, so
        # free() costs O(freed) instead of re-copying the whole free list every call.
        self._released = []
        self._num_released = 0

    def _num_free_pages(self) -> int:
        return int(self._free_pages.numel()) + self._num_released

    def available_size(self) -> int:
        return self._num_free_pages() * self.page_size

    def _merge_released(self) -> None:
        if self._released:
            self._free_pages = torch.cat([self._free_pages, *self._released])
            self._released = []
            self._num_released = 0

    def _take_pages(self, n: int) -> torch.Tensor:
        if n > self._free_pages.numel():
            self._merge_released()
        pages = self._free_pages[:n]
        self._free_pages = self._free_pages[n:]
        self._is_free[pages] = False
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages.unsqueeze(1) * self.page_size + offsets).reshape(-1)

    def alloc_extend(
        self, prefix_lens: list[int], last_locs: list[int], extend_lens: list[int]
    ) -> torch.Tensor | None:
        if not len(prefix_lens) == len(last_locs) == len(extend_lens):
            raise ValueError("prefix_lens, last_locs and extend_lens must have the same length")
        if self.page_size == 1:
            total = sum(extend_lens)
            if total > self._num_free_pages():
                return None
            return self._take_pages(total)

        ps = self.page_size
        # First pass only counts, so that failure leaves the allocator untouched.
        fills: list[int] = []
        new_pages: list[int] = []
        for prefix_len, last_loc, extend_len in zip(prefix_lens, last_locs, extend_lens, strict=True):
            in_page = prefix_len % ps
            if in_page and last_loc % ps != in_page - 1:
                raise ValueError(
                    f"last_loc {last_loc} is not at page offset {in_page - 1} for prefix_len {prefix_len}"
                )
            fill = min(extend_len, ps - in_page) if in_page else 0
            fills.append(fill)
            new_pages.append(-(-(extend_len - fill) // ps))
        if sum(new_pages) > self._num_free_pages():
            return None

        pages = self._take_pages(sum(new_pages))
        parts: list[torch.Tensor] = []
        page_start = 0
        for last_loc, extend_len, fill, n_pages in zip(last_locs, extend_lens, fills, new_pages, strict=True):
            if fill:
                parts.append(
                    torch.arange(last_loc + 1, last_loc + 1 + fill, dtype=torch.int64, device=self.device)
                )
            if n_pages:
                own = pages[page_start : page_start + n_pages]
                parts.append(self._pages_to_slots(own)[: extend_len - fill])
                page_start += n_pages
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        if len(seq_lens) != len(last_locs):
            raise ValueError("seq_lens and last_locs must have the same length")
        if self.page_size == 1:
            # Hot path: one call per decode step, so no per-request work at all.
            n = len(seq_lens)
            if n > self._num_free_pages():
                return None
            return self._take_pages(n)

        ps = self.page_size
        needs_page = [seq_len % ps == 0 for seq_len in seq_lens]
        n_new = sum(needs_page)
        if n_new > self._num_free_pages():
            return None
        for seq_len, last_loc, new in zip(seq_lens, last_locs, needs_page, strict=True):
            if not new and last_loc % ps != seq_len % ps - 1:
                raise ValueError(f"last_loc {last_loc} is not at page offset {seq_len % ps - 1}")
        out = torch.tensor(last_locs, dtype=torch.int64, device=self.device) + 1
        if n_new:
            mask = torch.tensor(needs_page, dtype=torch.bool, device=self.device)
            out[mask] = self._take_pages(n_new) * ps
        return out

    def release_window(self, slots: torch.Tensor) -> int:
        """The sliding-window layers' K/V at these slots will not be read again; how many window
        slots that gave back."""
        return 0

    def window_excess(self) -> int:
        """Window slots the cache should give back, its prefixes' least recently used first: the
        use over the window budget and some slack below it (0: within it, or no window slots)."""
        return 0

    def window_available(self) -> int | None:
        """Free window slots (None: the pool has none)."""
        return None

    def reusable_prefix_len(self, slots: torch.Tensor) -> int:
        """How many of a cached prefix's positions (these slots) a request can continue from."""
        return int(slots.numel())

    def adopt_window(self, kept: torch.Tensor, duplicates: torch.Tensor) -> None:
        """kept[i] (the cache's slot) takes the window K/V of duplicates[i] (a request's slot for the
        same token, about to be freed) where kept[i] has none."""

    def window_leak(self, held: torch.Tensor) -> str | None:
        """When idle: what is wrong with the window slots, given every slot the cache holds."""
        return None

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        if self.page_size == 1:
            pages = slots
            if torch.unique(pages).numel() != pages.numel():
                raise ValueError("double free: duplicate slots in one free() call")
        else:
            # Several slots of one page are the normal case (a request's partial page).
            pages = torch.unique(slots // self.page_size)
        if bool(((pages < 0) | (pages >= self.num_pages)).any()):
            raise ValueError(f"slot out of range [0, {self.total_slots})")
        if bool(self._is_free[pages].any()):
            bad = pages[self._is_free[pages]][:8].tolist()
            raise ValueError(f"double free of KV page(s) {bad} (page_size={self.page_size})")
        self._is_free[pages] = True
        # Copy: `pages` may be a view of a caller's tensor (a req_to_token row) that gets overwritten.
        self._released.append(pages.clone())
        self._num_released += int(pages.numel())
