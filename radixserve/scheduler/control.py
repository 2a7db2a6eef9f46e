"""The scheduler's control commands (everything that is not a generation request): one function
per command, looked up by name, over the scheduler's parts (ControlParts). Each returns its payload
and any request outputs it caused (a weight change aborts the requests in flight); a refusal raises
ControlError."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.radix_cache import TreeNode
from radixserve.cache.tiers import CacheTier
from radixserve.cache.tree_summary import summarize_tree
from radixserve.config.server_args import ServerArgs
from radixserve.executor.base import (
    MEMORY_TAGS,
    Executor,
    ExpertRecording,
    MemoryControl,
    MemoryReleasedError,
    MissingCapabilityError,
    WeightControl,
)
from radixserve.models.lora_adapter import LoraAdapterError
from radixserve.protocol.messages import ControlRequest, ControlResult, SchedulerOutput
from radixserve.scheduler.accounting import KVAccounting
from radixserve.scheduler.batch import KVContext
from radixserve.scheduler.decode import DecodeManager
from radixserve.scheduler.disaggregation.decode import DecodeHandoffs
from radixserve.scheduler.disaggregation.prefill import PrefillHandoffs
from radixserve.scheduler.grammar_queue import GrammarQueue
from radixserve.scheduler.images import ImageEncoder
from radixserve.scheduler.internal_state import (
    InvalidStateError,
    Tunables,
    get_internal_state,
    set_internal_state,
)
from radixserve.scheduler.kv_events import KVEventPublisher
from radixserve.scheduler.lora import LoraError, LoraManager
from radixserve.scheduler.pipeline import MicroBatchPipeline
from radixserve.scheduler.prefill import PrefillManager
from radixserve.scheduler.profiler import ProfilerError, StepProfiler
from radixserve.scheduler.request import Req
from radixserve.scheduler.speculative.worker import Speculator
from radixserve.scheduler.state import RequestQueues
from radixserve.scheduler.stats import SchedulerStats


@dataclass
class ForwardDelay:
    """/slow_down's test hook: how long the scheduler sleeps before every forward. Mutable and
    shared: the command sets it, the scheduler reads it each step."""

    seconds: float = 0.0


@dataclass(frozen=True)
class ControlParts:
    """What the commands read and change: the scheduler's parts, built once by the scheduler
    (scheduler.py) and handed here, so this module never needs the scheduler itself (which imports
    it to run the commands)."""

    args: ServerArgs
    max_total_tokens: int
    context_len: int
    queues: RequestQueues
    # Every request in flight by rid (the scheduler's own dict: it stays current).
    reqs: dict[str, Req]
    kv: KVContext
    accounting: KVAccounting
    prefill: PrefillManager
    decode: DecodeManager
    grammar_queue: GrammarQueue
    stats: SchedulerStats
    profiler: StepProfiler
    cache_tier: CacheTier
    delay: ForwardDelay
    # The executor, for what every executor answers (describe, stats) and to name it in a refusal,
    # and the optional capabilities the commands use, narrowed once (None: it lacks them).
    executor: Executor
    memory: MemoryControl | None
    weights: WeightControl | None
    experts: ExpertRecording | None
    # The features that may be off (None).
    overlap_schedule: bool
    kv_events: KVEventPublisher | None
    speculator: Speculator | None
    lora: LoraManager | None
    images: ImageEncoder | None
    pipeline: MicroBatchPipeline | None
    handoffs: PrefillHandoffs | DecodeHandoffs | None
    # What only the scheduler as a whole can answer or do: whether anything is left to run (its
    # components and the unpublished results count too); emptying the cache when idle (False when
    # not); aborting every request, first landing the micro-batches in flight, then flushing.
    is_idle: Callable[[], bool]
    flush_cache: Callable[[], bool]
    abort_all_and_flush: Callable[[], list[SchedulerOutput]]


class ControlError(Exception):
    """A control command refused, with a message for the caller."""


@dataclass
class Reply:
    payload: dict[str, Any] = field(default_factory=dict)
    outputs: list[SchedulerOutput] = field(default_factory=list)


class Controls:
    """Runs the commands over the scheduler's parts. A KV invariant check asked for while requests
    run waits here until the scheduler is idle (the invariant holds only then)."""

    def __init__(self, parts: ControlParts):
        self.parts = parts
        self.idle_waiters: list[ControlRequest] = []

    def handle(self, msg: ControlRequest) -> list[SchedulerOutput]:
        """The command's outputs, ending with its ControlResult; none yet for a deferred answer."""
        if msg.command == "check_kv_invariant" and not self.parts.is_idle():
            self.idle_waiters.append(msg)
            return []
        return run_command(self.parts, msg)

    def answer_idle_waiters(self) -> list[SchedulerOutput]:
        """At the end of a step: the deferred checks, once the scheduler is idle."""
        if not self.idle_waiters or not self.parts.is_idle():
            return []
        waiters, self.idle_waiters = self.idle_waiters, []
        return [out for msg in waiters for out in run_command(self.parts, msg)]


def run_command(parts: ControlParts, msg: ControlRequest) -> list[SchedulerOutput]:
    command = COMMANDS.get(msg.command)
    if command is None:
        return [ControlResult(msg.rid, False, error=f"unknown control command {msg.command!r}")]
    try:
        reply = command(parts, msg.args)
    except (ControlError, InvalidStateError, ProfilerError, MemoryReleasedError, KeyError) as exc:
        # str() of a KeyError quotes its message.
        message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        return [ControlResult(msg.rid, False, error=message)]
    except Exception as exc:  # reported to the caller, who decides whether it is fatal
        return [ControlResult(msg.rid, False, error=f"{type(exc).__name__}: {exc}")]
    return [*reply.outputs, ControlResult(msg.rid, True, payload=reply.payload)]


def _require_idle(parts: ControlParts, what: str) -> None:
    if not parts.is_idle():
        raise ControlError(f"cannot {what} while requests are running; retry when idle")


def check_kv_invariant(parts: ControlParts, args: dict[str, Any]) -> Reply:
    parts.accounting.check_invariant()
    return Reply()


def flush_cache(parts: ControlParts, args: dict[str, Any]) -> Reply:
    if not parts.flush_cache():
        raise ControlError("requests are still running")
    return Reply()


def get_stats(parts: ControlParts, args: dict[str, Any]) -> Reply:
    s, idle = parts, parts.is_idle()
    return Reply(
        {
            "idle": idle,
            # Checked on the spot when idle: "ok" or what leaked; it only holds when idle.
            "kv_invariant": s.accounting.describe_invariant() if idle else "not checked: busy",
            "max_total_tokens": s.max_total_tokens,
            "context_len": s.context_len,
            "available_tokens": s.kv.allocator.available_size(),
            "evictable_tokens": s.kv.tree_cache.evictable_size(),
            # Free window slots, where sliding-window layers hold their K/V in them (cache/swa_pool.py).
            "window_available_tokens": s.kv.allocator.window_available(),
            "token_usage": s.accounting.token_usage(),
            "num_running_reqs": len(s.queues.running),
            "num_waiting_reqs": len(s.queues.waiting),
            "new_token_ratio": s.decode.new_token_ratio,
            "forward_steps": s.stats.forward_steps,
            "prefill_batches": s.stats.prefill_batches,
            "decode_steps": s.stats.decode_steps,
            "retracted_reqs": s.stats.retracted_reqs,
            "overlap_schedule": s.overlap_schedule,
            "overlapped_steps": s.stats.overlapped_steps,
            "step_time_s": s.stats.step_time_s,
            "forward_time_s": s.stats.forward_time_s,
            # The scheduler's own time before each back-to-back decode step, as a line in its
            # rows (what calibrate holds the simulator's cost per row at).
            "decode_host_time": s.stats.decode_host_time.describe(),
            # The attention backend, decode path and CPU kernels chosen at startup, and their counters.
            **s.executor.describe(),
            **s.executor.stats(),
            "aborted_reqs": s.stats.aborted_reqs,
            "cached_tokens": s.stats.cached_tokens,
            "generated_tokens": s.stats.generated_tokens,
            "cache_hit_rate": s.stats.cache_hit_rate,
            "gen_throughput": s.stats.gen_throughput,
            "inter_token_latency": s.stats.inter_token_latency,
            "time_to_first_token": s.stats.time_to_first_token,
            # Speculative decoding (SGLang's names): tokens per request per verify step, and
            # the share of draft tokens accepted; 0 when it is off or has not verified yet.
            "speculative_algorithm": s.args.speculative_algorithm,
            "speculative_draft_model_path": s.args.speculative_draft_model_path,
            "avg_spec_accept_length": s.stats.spec_accept_length,
            "spec_accept_rate": s.stats.spec_accept_rate,
            "spec_verify_steps": s.stats.spec_verify_reqs,
            "spec_draft_tokens": s.stats.spec_draft_tokens,
            "spec_accepted_tokens": s.stats.spec_accepted_tokens,
            "num_grammar_queue_reqs": len(s.grammar_queue.pending),
            # --kv-events-config: where this replica publishes, and the batches sent and dropped.
            "kv_events_endpoint": s.kv_events.endpoint if s.kv_events else None,
            "kv_events_published": s.kv_events.published if s.kv_events else 0,
            "kv_events_dropped": s.kv_events.dropped if s.kv_events else 0,
            # --enable-hierarchical-cache: the tier below the device pool (cache/storage_tier.py).
            "hicache_tier": s.cache_tier.name,
            **s.cache_tier.stats(),
            # --enable-lora: the adapters loaded, and the slot each holds (None: none now).
            "lora_adapters": [] if s.lora is None else s.lora.describe(),
            # Vision-language models: images run through the vision encoder (cache hits are not).
            "images_encoded": 0 if s.images is None else s.images.images_encoded,
            # --pp-size: the micro-batch pipeline's ticks and how busy its stages were kept.
            "pipeline": {"stages": 1} if s.pipeline is None else s.pipeline.stats(),
            # --disaggregation-mode: this half's handoffs (distributed/kv_transfer.py).
            "disaggregation": {"mode": "null"} if s.handoffs is None else s.handoffs.stats(),
            "memory_released": [] if s.memory is None else sorted(s.memory.released),
            "resident_bytes": {} if s.memory is None else s.memory.resident_bytes(),
            # SGLang's load: KV tokens in use plus the tokens the waiting requests still need.
            "load_tokens": s.max_total_tokens
            - s.kv.available_with_eviction()
            + sum(r.seq_len for r in s.queues.waiting + s.grammar_queue.pending),
        }
    )


# The dashboard lists at most this many running and waiting requests per replica.
DASHBOARD_LIST = 50


def dashboard_state(parts: ControlParts, args: dict[str, Any]) -> Reply:
    """What /dashboard shows of this replica: its queues with ages, the KV pool split into what
    running requests hold, what the cache could evict and what is free, and the radix tree's
    largest prefixes (token ids: the engine decodes the previews)."""
    now = time.monotonic()
    total = parts.max_total_tokens
    free = parts.kv.allocator.available_size()
    cached = parts.kv.tree_cache.evictable_size()
    running = sorted(parts.queues.running, key=lambda r: r.arrival_time)[:DASHBOARD_LIST]
    waiting = sorted(parts.queues.waiting, key=lambda r: r.arrival_time)[:DASHBOARD_LIST]
    root = getattr(parts.kv.tree_cache, "root", None)
    return Reply(
        {
            "num_running": len(parts.queues.running),
            "num_waiting": len(parts.queues.waiting),
            "num_grammar_queue": len(parts.grammar_queue.pending),
            "retracted_reqs": parts.stats.retracted_reqs,
            "cache_hit_rate": parts.stats.cache_hit_rate,
            "running": [
                {
                    "rid": r.rid,
                    "age_s": now - r.arrival_time,
                    "prompt_tokens": len(r.origin_input_ids),
                    "output_tokens": len(r.output_ids),
                }
                for r in running
            ],
            "waiting": [
                {"rid": r.rid, "age_s": now - r.arrival_time, "prompt_tokens": len(r.origin_input_ids)}
                for r in waiting
            ],
            "kv": {"total": total, "running": total - free - cached, "cached": cached, "free": free},
            "radix_tree": summarize_tree(root) if isinstance(root, TreeNode) else None,
        }
    )


def _tunables(parts: ControlParts) -> Tunables:
    slots = parts.kv.req_to_token_pool.size - 1
    return Tunables(parts.args, parts.prefill, parts.decode, slots)


def get_state(parts: ControlParts, args: dict[str, Any]) -> Reply:
    return Reply(get_internal_state(_tunables(parts), parts.delay.seconds))


def set_state(parts: ControlParts, args: dict[str, Any]) -> Reply:
    set_internal_state(_tunables(parts), args)
    return get_state(parts, {})


def slow_down(parts: ControlParts, args: dict[str, Any]) -> Reply:
    parts.delay.seconds = float(args.get("forward_sleep_time") or 0.0)
    return get_state(parts, {})


def start_profile(parts: ControlParts, args: dict[str, Any]) -> Reply:
    num_steps = args.get("num_steps")
    steps = None if num_steps is None else int(num_steps)
    return Reply(parts.profiler.start(args.get("output_dir"), steps, bool(args.get("profile_by_stage"))))


def stop_profile(parts: ControlParts, args: dict[str, Any]) -> Reply:
    return Reply(parts.profiler.stop())


def _experts(parts: ControlParts) -> ExpertRecording:
    if parts.experts is None:
        raise ControlError(str(MissingCapabilityError(parts.executor, ExpertRecording, "recording experts")))
    if not parts.executor.info.config.sparse_layers:
        raise ControlError("this model has no Mixture-of-Experts layers to record")
    return parts.experts


def start_expert_record(parts: ControlParts, args: dict[str, Any]) -> Reply:
    """SGLang's /start_expert_distribution_record: counting starts from zero."""
    _experts(parts).record_experts(True)
    return Reply({"recording": True})


def stop_expert_record(parts: ControlParts, args: dict[str, Any]) -> Reply:
    _experts(parts).record_experts(False)
    return Reply({"recording": False})


def dump_expert_record(parts: ControlParts, args: dict[str, Any]) -> Reply:
    """Per sparse layer, the tokens routed to each expert in the last (or current) recording."""
    counts = _experts(parts).expert_counts()
    return Reply({"layers": {str(layer): tally for layer, tally in counts.items()}})


def _weights(parts: ControlParts) -> WeightControl:
    if parts.weights is None:
        missing = MissingCapabilityError(parts.executor, WeightControl, "reading or changing weights")
        raise ControlError(str(missing))
    return parts.weights


def _memory(parts: ControlParts) -> MemoryControl:
    if parts.memory is None:
        raise ControlError(str(MissingCapabilityError(parts.executor, MemoryControl, "releasing memory")))
    return parts.memory


def get_weights_by_name(parts: ControlParts, args: dict[str, Any]) -> Reply:
    values = _weights(parts).weight_slice(str(args["name"]), int(args.get("truncate_size", 100)))
    return Reply({"values": values})


def update_weights_from_disk(parts: ControlParts, args: dict[str, Any]) -> Reply:
    """The new weights load first (a failure changes nothing); then every request in flight is
    aborted, since its KV came from the old weights, and the cache is emptied for the same reason."""
    path = _weights(parts).load_other_weights(str(args.get("model_path")))
    parts.cache_tier.weights_changed()
    outputs = parts.abort_all_and_flush()
    return Reply({"model_path": path}, outputs)


def update_weights_from_tensor(parts: ControlParts, args: dict[str, Any]) -> Reply:
    """Named tensors, sent as safetensors bytes (never pickle); all or nothing, then as above."""
    from safetensors.torch import load

    try:
        named = list(load(bytes(args["tensors"])).items())
    except Exception as exc:
        raise ControlError(f"the tensors are not valid safetensors data: {exc}") from exc
    used = _weights(parts).update_weights_from_tensors(named)
    parts.cache_tier.weights_changed()
    outputs = parts.abort_all_and_flush() if args.get("flush_cache", True) else []
    return Reply({"num_updated": used}, outputs)


def _tags(args: dict[str, Any]) -> set[str]:
    tags = args.get("tags") or list(MEMORY_TAGS)
    unknown = set(tags) - set(MEMORY_TAGS)
    if not isinstance(tags, list) or unknown:
        raise ControlError(f"tags must be a list of {', '.join(MEMORY_TAGS)}; got {tags!r}")
    return set(tags)


def release_memory_occupation(parts: ControlParts, args: dict[str, Any]) -> Reply:
    tags, memory = _tags(args), _memory(parts)
    _require_idle(parts, "release memory")
    if "kv_cache" in tags:
        parts.flush_cache()  # the cached prefixes' KV is about to be gone
    memory.release_memory(tags)
    if parts.speculator is not None:
        parts.speculator.release_memory(tags)  # a draft model's memory goes with the target's
    return Reply({"released": sorted(memory.released)})


def resume_memory_occupation(parts: ControlParts, args: dict[str, Any]) -> Reply:
    tags, memory = _tags(args), _memory(parts)
    memory.resume_memory(tags)
    if parts.speculator is not None:
        parts.speculator.resume_memory(tags)
    return Reply({"released": sorted(memory.released)})


def load_lora_adapter(parts: ControlParts, args: dict[str, Any]) -> Reply:
    """{"lora_name", "lora_path"}: a PEFT adapter, read and checked before anything uses it."""
    lora = _lora(parts)
    try:
        lora.load(str(args["lora_name"]), str(args["lora_path"]))
    except (LoraError, LoraAdapterError) as exc:
        raise ControlError(str(exc)) from exc
    return Reply({"loaded_adapters": {a.name: a.path for a in lora.adapters.values()}})


def unload_lora_adapter(parts: ControlParts, args: dict[str, Any]) -> Reply:
    """Refused while requests in flight use the adapter."""
    lora = _lora(parts)
    try:
        lora.unload(str(args["lora_name"]), parts.reqs.values())
    except LoraError as exc:
        raise ControlError(str(exc)) from exc
    return Reply({"loaded_adapters": {a.name: a.path for a in lora.adapters.values()}})


def _lora(parts: ControlParts) -> LoraManager:
    if parts.lora is None:
        raise ControlError("LoRA adapters need a server started with --enable-lora")
    return parts.lora


def clear_hicache_storage_backend(parts: ControlParts, args: dict[str, Any]) -> Reply:
    """Removes every page the storage tier keeps (/flush_cache empties the device tree alone)."""
    parts.cache_tier.clear()
    return Reply()


COMMANDS: dict[str, Callable[[ControlParts, dict[str, Any]], Reply]] = {
    "clear_hicache_storage_backend": clear_hicache_storage_backend,
    "load_lora_adapter": load_lora_adapter,
    "unload_lora_adapter": unload_lora_adapter,
    "check_kv_invariant": check_kv_invariant,
    "flush_cache": flush_cache,
    "get_stats": get_stats,
    "dashboard_state": dashboard_state,
    "get_internal_state": get_state,
    "set_internal_state": set_state,
    "slow_down": slow_down,
    "start_profile": start_profile,
    "start_expert_distribution_record": start_expert_record,
    "stop_expert_distribution_record": stop_expert_record,
    "dump_expert_distribution_record": dump_expert_record,
    "stop_profile": stop_profile,
    "get_weights_by_name": get_weights_by_name,
    "update_weights_from_disk": update_weights_from_disk,
    "update_weights_from_tensor": update_weights_from_tensor,
    "release_memory_occupation": release_memory_occupation,
    "resume_memory_occupation": resume_memory_occupation,
}
