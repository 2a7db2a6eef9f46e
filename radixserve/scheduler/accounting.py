"""The scheduler's KV accounting: how much of the pool is in use, the invariant that holds whenever
the scheduler is idle, and the self-check that tests it once per idle spell.

Plain objects over the parts they read (the scheduler builds them once, scheduler.py): the control
commands (control.py) report and check the same accounting without reaching into the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cache.radix_cache import KVLeakError
from radixserve.cache.tiers import CacheTier
from radixserve.executor.base import Executor
from radixserve.scheduler.batch import KVContext
from radixserve.scheduler.speculative.worker import Speculator
from radixserve.scheduler.state import token_usage


@dataclass(frozen=True)
class KVAccounting:
    """The request slots, the device pool's KV slots, the radix cache over them and the tier below."""

    kv: KVContext
    cache_tier: CacheTier
    max_total_tokens: int

    def token_usage(self) -> float:
        return token_usage(self.kv, self.max_total_tokens)

    def check_invariant(self) -> None:
        """Raises KVLeakError unless every KV slot is free or evictable and every request slot is
        free, and the tier below keeps its own accounting. Only an idle scheduler can pass."""
        self.kv.tree_cache.check_invariant()
        problems = self.cache_tier.check_invariant()
        if problems:
            raise KVLeakError("; ".join(problems))

    def describe_invariant(self) -> str:
        """ "ok", or what leaked (get_stats reports it rather than failing)."""
        try:
            self.check_invariant()
        except KVLeakError as exc:
            return f"violated: {exc}"
        return "ok"


@dataclass
class IdleSelfCheck:
    """When the scheduler goes idle: the executor and the speculator give back the memory they keep
    between steps, and the KV invariant is checked (a leak fails loudly, near its cause)."""

    executor: Executor
    speculator: Speculator | None
    accounting: KVAccounting
    # Once per idle spell: a request's arrival makes the next one due.
    due: bool = False

    def request_arrived(self) -> None:
        self.due = True

    def run(self) -> None:
        if not self.due:
            return
        self.executor.idle()
        if self.speculator is not None:
            self.speculator.idle()
        self.accounting.check_invariant()
        self.due = False
