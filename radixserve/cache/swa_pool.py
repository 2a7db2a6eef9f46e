"""Window slots: the K/V of sliding-window layers, held only while a request may still attend them.

A token's K/V in a layer with a window of W is read by the queries at most W - 1 positions after
it. Once a request has moved past that, the sliding layers' K/V of the token is dead weight, while
the full-attention layers still need theirs. So the two kinds of layers are addressed apart:

* every token has a slot (KVSlotAllocator: the full layers' K/V, the radix tree's values, the
  request's req_to_token row), and
* while its window K/V is alive, a window slot, `window_map[slot]`, where the sliding layers keep
  theirs (their buffers: cache/pools.py, KVCachePool.window_layers).

Releasing a position (`release_window`) returns its window slot and points it at `released`, a
spare row that attention never reads unmasked. Window slots are reused most recently released
first, so the memory the sliding layers touch stays that of the windows alive, not of every token
served. There are as many window slots as slots (a slot has at most one), so a slot allocation
never waits on them: the scheduler's budget is the slots' alone.

What bounds the memory the sliding layers touch is the window budget (--swa-full-tokens-ratio of
the slots): while more window slots are in use, the radix cache gives back the window K/V of its
least recently used unlocked prefixes (`window_excess`, RadixCache._trim_windows). A running
request's own window K/V is never taken, so the budget bounds what the cache keeps, and a request
never waits on it.

A cached prefix whose window K/V was partly released (a finished request's early positions) still
serves its full layers, but a request can continue from it only at a length whose last W - 1
positions are alive (`reusable_prefix_len`), and the radix tree matches no further.
"""

from __future__ import annotations

import torch

from radixserve.cache.pools import KVSlotAllocator

__all__ = ["WindowSlotAllocator"]

# Over its budget, the cache gives window slots back down to budget - budget / this.
WINDOW_TRIM_MARGIN = 8


class WindowSlotAllocator(KVSlotAllocator):
    """Slots, each with a window slot while its sliding layers' K/V is alive (page size 1)."""

    window: int
    window_map: torch.Tensor

    def __init__(
        self, num_slots: int, window: int, device: torch.device | str = "cpu", budget: int | None = None
    ) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        # Window slots in use past which the cache gives its prefixes' window K/V back.
        self.budget = num_slots if budget is None else budget
        if self.budget <= 0:
            raise ValueError(f"window budget must be positive, got {budget}")
        # The spare row of the sliding layers' buffers, where a released position points (with
        # page size 1 the allocator's total is num_slots).
        self.released = num_slots
        super().__init__(num_slots, page_size=1, device=device)

    def clear(self) -> None:
        super().clear()
        total, device = self.total_slots, self.device
        # What batches carry to the executor.
        self.window_map = torch.full((total,), self.released, dtype=torch.int64, device=device)
        # A stack of free window slots: [0, _free_count) are free, the top is reused first.
        self.window_free = torch.arange(total - 1, -1, -1, dtype=torch.int64, device=device)
        self._free_count = self.total_slots

    def window_available(self) -> int:
        return self._free_count

    def _give_window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        n = int(slots.numel())
        # A slot just allocated has no window slot, and there are as many of each.
        assert n <= self._free_count, "more slots than window slots: the allocator's counts are off"
        self._free_count -= n
        self.window_map[slots] = self.window_free[self._free_count : self._free_count + n].flip(0)
        return slots

    def alloc_extend(
        self, prefix_lens: list[int], last_locs: list[int], extend_lens: list[int]
    ) -> torch.Tensor | None:
        slots = super().alloc_extend(prefix_lens, last_locs, extend_lens)
        return None if slots is None else self._give_window_slots(slots)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        slots = super().alloc_decode(seq_lens, last_locs)
        return None if slots is None else self._give_window_slots(slots)

    def window_excess(self) -> int:
        in_use = self.total_slots - self._free_count
        if in_use <= self.budget:
            return 0
        # Down to a margin below the budget, so that the cache's walk for it is not taken again
        # for every request that finishes next.
        return in_use - (self.budget - self.budget // WINDOW_TRIM_MARGIN)

    def release_window(self, slots: torch.Tensor) -> int:
        if slots.numel() == 0:
            return 0
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        held = self.window_map[slots]
        held = held[held != self.released]
        n = int(held.numel())
        if n:
            if torch.unique(held).numel() != n:
                raise ValueError("double release: duplicate slots in one release_window() call")
            self.window_free[self._free_count : self._free_count + n] = held
            self._free_count += n
        self.window_map[slots] = self.released
        return n

    def free(self, slots: torch.Tensor) -> None:
        self.release_window(slots)
        super().free(slots)

    def reusable_prefix_len(self, slots: torch.Tensor) -> int:
        """The longest length L <= len(slots) whose positions [L - W + 1, L) all have their window
        K/V: what a request continuing at position L reads of the sliding layers."""
        count = int(slots.numel())
        dead = self.window_map[slots.to(device=self.device, dtype=torch.int64)] == self.released
        if count == 0 or not bool(dead.any()):
            return count
        dead_before = torch.zeros(count + 1, dtype=torch.int64, device=self.device)
        dead_before[1:] = dead.cumsum(0)
        lengths = torch.arange(count + 1, device=self.device)
        window_start = (lengths - self.window + 1).clamp(min=0)
        usable = (dead_before - dead_before[window_start]) == 0
        return int(usable.nonzero()[-1])

    def adopt_window(self, kept: torch.Tensor, duplicates: torch.Tensor) -> None:
        if kept.numel() == 0:
            return
        kept = kept.to(device=self.device, dtype=torch.int64)
        duplicates = duplicates.to(device=self.device, dtype=torch.int64)
        take = (self.window_map[kept] == self.released) & (self.window_map[duplicates] != self.released)
        if bool(take.any()):
            self.window_map[kept[take]] = self.window_map[duplicates[take]]
            self.window_map[duplicates[take]] = self.released

    def window_leak(self, held: torch.Tensor) -> str | None:
        live = int((self.window_map[held.to(device=self.device, dtype=torch.int64)] != self.released).sum())
        mapped = int((self.window_map != self.released).sum())
        if live + self._free_count != self.total_slots or mapped != live:
            return (
                f"window slots: free {self._free_count} + held by the cache {live} != total "
                f"{self.total_slots}, {mapped} mapped in all"
            )
        return None
