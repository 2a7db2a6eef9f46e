"""Multi-LoRA scheduling (--enable-lora): which adapter each request runs with, which adapters a
batch may hold, and which adapter is in which slot of the executor's pool.

- A request names its adapter (`lora_path`, SGLang's field, holding the adapter's name); it is
  keyed in the radix cache in the adapter's namespace (cache/key_space.py), derived from the
  adapter's weights, so no two adapters (and not the base model) ever share K/V, and an adapter
  loaded again, even after a restart, finds its own.
- The executor's pool has --max-loras-per-batch slots. Every running request takes part in each
  decode step, so the adapters of the running requests and of those admitted must fit in the slots
  together: admission skips a request whose adapter would be one too many (it waits its turn).
- When a batch is admitted, each adapter it needs and no slot holds goes into a free slot, or
  else the least recently used slot whose adapter no admitted or running request uses. So an
  adapter in use is never evicted.
- Unloading an adapter that requests in flight use is refused (they keep it until they finish).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from radixserve.cache.key_space import namespace_of
from radixserve.executor.base import Executor, LoraAdapterInfo, LoraSlots, MissingCapabilityError
from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.scheduler.request import Req


class LoraError(InvalidRequestError):
    """An adapter request refused: the message says why (a 400 for the caller)."""


class LoraManager:
    def __init__(self, executor: Executor, slots: int):
        if not isinstance(executor, LoraSlots):
            raise MissingCapabilityError(executor, LoraSlots, "--enable-lora")
        self.executor = executor
        self.adapters: dict[str, LoraAdapterInfo] = {a.name: a for a in executor.lora_adapters()}
        self.slot_names: list[str | None] = [None] * slots
        self._last_used = [0] * slots
        self._clock = itertools.count(1)

    @property
    def slots(self) -> int:
        return len(self.slot_names)

    def attach(self, req: Req, name: str | None) -> None:
        """Sets the request's adapter (None: the base model); LoraError for an unknown one."""
        if name is None:
            return
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise LoraError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        req.lora_name = name
        req.cache_namespace = namespace_of(adapter.fingerprint)

    @staticmethod
    def in_use(reqs: Iterable[Req]) -> set[str]:
        return {r.lora_name for r in reqs if r.lora_name is not None}

    def fits(self, req: Req, active: set[str]) -> bool:
        """Whether req may join a batch whose requests (and the running ones) use `active`."""
        return req.lora_name is None or req.lora_name in active or len(active) < self.slots

    def bind(self, batch: list[Req], active: set[str]) -> None:
        """Gives every adapter of the batch a slot (active: every adapter admitted or running
        requests use, which keep theirs) and sets each request's lora_slot."""
        for name in sorted(self.in_use(batch) - set(self.slot_names)):
            free = [s for s, held in enumerate(self.slot_names) if held is None or held not in active]
            if not free:
                raise RuntimeError("a batch needs more adapters than --max-loras-per-batch; this is a bug")
            slot = min(free, key=lambda s: (self.slot_names[s] is not None, self._last_used[s]))
            self.executor.set_lora_slot(slot, name)
            self.slot_names[slot] = name
        tick = next(self._clock)
        for req in batch:
            if req.lora_name is not None:
                req.lora_slot = self.slot_names.index(req.lora_name)
                self._last_used[req.lora_slot] = tick

    def load(self, name: str, path: str) -> LoraAdapterInfo:
        if name in self.adapters:
            raise LoraError(f"a LoRA adapter named {name!r} is loaded already; unload it first")
        adapter = self.executor.load_lora(name, path)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str, requests: Iterable[Req]) -> None:
        """Refused while a request in flight (any of `requests`) uses the adapter."""
        if name not in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        users = sorted(r.rid for r in requests if r.lora_name == name)
        if users:
            raise LoraError(f"LoRA adapter {name!r} is in use by {len(users)} request(s) in flight; retry")
        self.executor.unload_lora(name)
        del self.adapters[name]
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self.slot_names[slot] = None

    def describe(self) -> list[dict[str, object]]:
        return [
            {"name": a.name, "path": a.path, "rank": a.rank, "slot": self._slot_of(a.name)}
            for a in sorted(self.adapters.values(), key=lambda a: a.name)
        ]

    def _slot_of(self, name: str) -> int | None:
        return self.slot_names.index(name) if name in self.slot_names else None
