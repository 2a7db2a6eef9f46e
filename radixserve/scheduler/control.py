"""The scheduler's control commands (everything that is not a generation request): one function
per command, looked up by name. Each returns its payload and any request outputs it caused (a
weight change aborts the requests in flight); a refusal raises ControlError."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.cache.radix_cache import KVLeakError
from radixserve.executor.model_runner import MEMORY_TAGS, MemoryReleasedError
from radixserve.protocol.messages import ControlRequest, ControlResult, SchedulerOutput
from radixserve.scheduler.internal_state import InvalidStateError, get_internal_state, set_internal_state
from radixserve.scheduler.profiler import ProfilerError

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler


class ControlError(Exception):
    """A control command refused, with a message for the caller."""


@dataclass
class Reply:
    payload: dict[str, Any] = field(default_factory=dict)
    outputs: list[SchedulerOutput] = field(default_factory=list)


def handle_control(scheduler: Scheduler, msg: ControlRequest) -> list[SchedulerOutput]:
    """The command's outputs, ending with its ControlResult; none yet for a deferred answer."""
    if msg.command == "check_kv_invariant" and not scheduler.is_idle:
        # The invariant only holds when idle: answered once the scheduler gets there.
        scheduler.idle_waiters.append(msg)
        return []
    command = COMMANDS.get(msg.command)
    if command is None:
        return [ControlResult(msg.rid, False, error=f"unknown control command {msg.command!r}")]
    try:
        reply = command(scheduler, msg.args)
    except (ControlError, InvalidStateError, ProfilerError, MemoryReleasedError, KeyError) as exc:
        # str() of a KeyError quotes its message.
        message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        return [ControlResult(msg.rid, False, error=message)]
    except Exception as exc:  # reported to the caller, who decides whether it is fatal
        return [ControlResult(msg.rid, False, error=f"{type(exc).__name__}: {exc}")]
    return [*reply.outputs, ControlResult(msg.rid, True, payload=reply.payload)]


def _require_idle(scheduler: Scheduler, what: str) -> None:
    if not scheduler.is_idle:
        raise ControlError(f"cannot {what} while requests are running; retry when idle")


def check_kv_invariant(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    scheduler.check_kv_invariant()
    return Reply()


def flush_cache(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    if not scheduler.flush_cache():
        raise ControlError("requests are still running")
    return Reply()


def get_stats(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    s = scheduler
    return Reply(
        {
            "idle": s.is_idle,
            # Checked on the spot when idle: "ok" or what leaked; it only holds when idle.
            "kv_invariant": _describe_kv_invariant(s) if s.is_idle else "not checked: busy",
            "max_total_tokens": s.max_total_tokens,
            "context_len": s.context_len,
            "available_tokens": s.allocator.available_size(),
            "evictable_tokens": s.tree_cache.evictable_size(),
            "token_usage": s.token_usage(),
            "num_running_reqs": len(s.running),
            "num_waiting_reqs": len(s.waiting),
            "new_token_ratio": s.new_token_ratio,
            "forward_steps": s.stats.forward_steps,
            "prefill_batches": s.stats.prefill_batches,
            "decode_steps": s.stats.decode_steps,
            "retracted_reqs": s.stats.retracted_reqs,
            "overlap_schedule": s.publisher is not None,
            "overlapped_steps": s.stats.overlapped_steps,
            "step_time_s": s.stats.step_time_s,
            "forward_time_s": s.stats.forward_time_s,
            # Decode buckets served from their staged K/V (appends) or refilled from the pool.
            "decode_staging_tokens": s.runner.staging.max_tokens,
            "decode_staging_appends": s.runner.staging.appends,
            "decode_staging_refills": s.runner.staging.refills,
            "aborted_reqs": s.stats.aborted_reqs,
            "cached_tokens": s.stats.cached_tokens,
            "generated_tokens": s.stats.generated_tokens,
            "cache_hit_rate": s.stats.cache_hit_rate,
            "gen_throughput": s.stats.gen_throughput,
            "inter_token_latency": s.stats.inter_token_latency,
            "time_to_first_token": s.stats.time_to_first_token,
            "num_grammar_queue_reqs": len(s.grammar_queue.pending),
            "memory_released": sorted(s.runner.released),
            "resident_bytes": s.runner.resident_bytes(),
            # SGLang's load: KV tokens in use plus the tokens the waiting requests still need.
            "load_tokens": s.max_total_tokens
            - s.kv.available_with_eviction()
            + sum(r.seq_len for r in s.waiting + s.grammar_queue.pending),
        }
    )


def _describe_kv_invariant(scheduler: Scheduler) -> str:
    try:
        scheduler.check_kv_invariant()
    except KVLeakError as exc:
        return f"violated: {exc}"
    return "ok"


def get_state(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    return Reply(get_internal_state(scheduler))


def set_state(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    return Reply(set_internal_state(scheduler, args))


def slow_down(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    scheduler.forward_sleep_s = float(args.get("forward_sleep_time") or 0.0)
    return Reply(get_internal_state(scheduler))


def start_profile(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    num_steps = args.get("num_steps")
    steps = None if num_steps is None else int(num_steps)
    return Reply(scheduler.profiler.start(args.get("output_dir"), steps, bool(args.get("profile_by_stage"))))


def stop_profile(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    return Reply(scheduler.profiler.stop())


def get_weights_by_name(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    values = scheduler.runner.weight_slice(str(args["name"]), int(args.get("truncate_size", 100)))
    return Reply({"values": values})


def update_weights_from_disk(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    """The new weights load first (a failure changes nothing); then every request in flight is
    aborted, since its KV came from the old weights, and the cache is emptied for the same reason."""
    scheduler.runner.load_other_weights(str(args.get("model_path")))
    outputs = scheduler.abort_all_and_flush()
    return Reply({"model_path": str(scheduler.runner.source.path)}, outputs)


def update_weights_from_tensor(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    """Named tensors, sent as safetensors bytes (never pickle); all or nothing, then as above."""
    from safetensors.torch import load

    try:
        named = list(load(bytes(args["tensors"])).items())
    except Exception as exc:
        raise ControlError(f"the tensors are not valid safetensors data: {exc}") from exc
    used = scheduler.runner.update_weights_from_tensors(named)
    outputs = scheduler.abort_all_and_flush() if args.get("flush_cache", True) else []
    return Reply({"num_updated": used}, outputs)


def _tags(args: dict[str, Any]) -> set[str]:
    tags = args.get("tags") or list(MEMORY_TAGS)
    unknown = set(tags) - set(MEMORY_TAGS)
    if not isinstance(tags, list) or unknown:
        raise ControlError(f"tags must be a list of {', '.join(MEMORY_TAGS)}; got {tags!r}")
    return set(tags)


def release_memory_occupation(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    tags = _tags(args)
    _require_idle(scheduler, "release memory")
    if "kv_cache" in tags:
        scheduler.flush_cache()  # the cached prefixes' KV is about to be gone
    scheduler.runner.release_memory(tags)
    return Reply({"released": sorted(scheduler.runner.released)})


def resume_memory_occupation(scheduler: Scheduler, args: dict[str, Any]) -> Reply:
    scheduler.runner.resume_memory(_tags(args))
    return Reply({"released": sorted(scheduler.runner.released)})


COMMANDS: dict[str, Callable[[Scheduler, dict[str, Any]], Reply]] = {
    "check_kv_invariant": check_kv_invariant,
    "flush_cache": flush_cache,
    "get_stats": get_stats,
    "get_internal_state": get_state,
    "set_internal_state": set_state,
    "slow_down": slow_down,
    "start_profile": start_profile,
    "stop_profile": stop_profile,
    "get_weights_by_name": get_weights_by_name,
    "update_weights_from_disk": update_weights_from_disk,
    "update_weights_from_tensor": update_weights_from_tensor,
    "release_memory_occupation": release_memory_occupation,
    "resume_memory_occupation": resume_memory_occupation,
}
