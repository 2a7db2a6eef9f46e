"""What /get_internal_state shows and what /set_internal_state may change, with range checks.

Only the knobs below can change at run time; everything else (the KV pool size, the model, the
request-slot pool) is fixed at startup. Each knob names the ServerArgs field it overrides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.config.server_args import ServerArgs
from radixserve.scheduler.decode import DecodeManager
from radixserve.scheduler.prefill import PrefillManager


@dataclass(frozen=True)
class Tunables:
    """Where the knobs live: the scheduler's args (its managers read the same object), the two
    managers, and the request slots allocated at startup (one spare for a chunked prefill)."""

    args: ServerArgs
    prefill: PrefillManager
    decode: DecodeManager
    request_slots: int


class InvalidStateError(ValueError):
    """A set_internal_state key that cannot change, or a value out of its range."""


@dataclass(frozen=True)
class Knob:
    kind: type
    check: Callable[[Any, Tunables], str | None]  # an error message, or None when the value is fine


def _at_least(low: float) -> Callable[[Any, Tunables], str | None]:
    return lambda v, _: None if v >= low else f"must be >= {low}"


def _running_limit(value: int, parts: Tunables) -> str | None:
    slots = parts.request_slots
    return (
        None if 1 <= value <= slots else f"must be in [1, {slots}] (the request slots allocated at startup)"
    )


def _chunk_size(value: int, parts: Tunables) -> str | None:
    page = parts.args.page_size
    return None if value == -1 or value >= page else f"must be -1 (off) or >= the page size {page}"


KNOBS: dict[str, Knob] = {
    "max_running_requests": Knob(int, _running_limit),
    "max_prefill_tokens": Knob(int, _at_least(1)),
    "chunked_prefill_size": Knob(int, _chunk_size),
    "schedule_conservativeness": Knob(float, lambda v, _: None if v > 0 else "must be > 0"),
    "stream_interval": Knob(int, _at_least(1)),
    "decode_log_interval": Knob(int, _at_least(1)),
}


def get_internal_state(parts: Tunables, forward_sleep_s: float) -> dict[str, Any]:
    args = parts.args
    return {
        "max_running_requests": parts.prefill.max_running,
        "max_prefill_tokens": args.max_prefill_tokens,
        "chunked_prefill_size": -1 if args.chunked_prefill_size is None else args.chunked_prefill_size,
        "schedule_conservativeness": args.schedule_conservativeness,
        "stream_interval": args.stream_interval,
        "decode_log_interval": args.decode_log_interval,
        "forward_sleep_s": forward_sleep_s,
        "settable": sorted(KNOBS),
    }


def set_internal_state(parts: Tunables, updates: dict[str, Any]) -> None:
    """Applies all updates or none (InvalidStateError, naming every problem)."""
    errors = []
    for key, value in updates.items():
        knob = KNOBS.get(key)
        if knob is None:
            errors.append(f"{key!r} cannot be changed (settable: {', '.join(sorted(KNOBS))})")
            continue
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not numeric or (knob.kind is int and not isinstance(value, int)):
            errors.append(f"{key} must be {knob.kind.__name__}, got {value!r}")
        elif (problem := knob.check(value, parts)) is not None:
            errors.append(f"{key} {problem}, got {value!r}")
    if errors:
        raise InvalidStateError("; ".join(errors))
    args = parts.args
    for key, value in updates.items():
        if key == "max_running_requests":
            parts.prefill.max_running = value
        elif key == "chunked_prefill_size":
            args.chunked_prefill_size = None if value == -1 else value
        elif key == "schedule_conservativeness":
            args.schedule_conservativeness = float(value)
            parts.decode.reset_new_token_ratio()
        else:
            setattr(args, key, value)
