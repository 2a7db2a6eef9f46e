"""--kv-events-config: the JSON object SGLang and vLLM take for publishing KV cache events.

Keys (all optional; vLLM's and SGLang's names and defaults, except the endpoints, which bind to
loopback unless told otherwise):

- "publisher": "zmq" (publish) or "null" (do not);
- "enable_kv_cache_events": vLLM's switch; false publishes nothing whatever "publisher" says;
- "endpoint": the ZMQ PUB address (default tcp://127.0.0.1:5557);
- "replay_endpoint": a ZMQ ROUTER address where a subscriber that fell behind asks for the batches
  from a sequence number on (default none);
- "buffer_steps": batches kept for replay (10000);
- "hwm": the PUB socket's high-water mark (100000);
- "max_queue_size": batches waiting for the publishing thread (100000); beyond, a batch is dropped
  and counted, never waited for;
- "topic": the first frame of every message ("").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
_TYPE_NAMES = {bool: "true or false", int: "an integer", str: "a string"}


@dataclass(frozen=True)
class KVEventsConfig:
    publisher: str = "zmq"
    enable_kv_cache_events: bool = True
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq" and self.enable_kv_cache_events


def parse_kv_events_config(text: str | None, error: type[ValueError]) -> KVEventsConfig | None:
    """The config --kv-events-config names, or None when it publishes nothing."""
    if text is None:
        return None
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"--kv-events-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise error("--kv-events-config must be a JSON object")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise error(f"--kv-events-config: unknown keys {unknown}; known: {sorted(known)}")
    defaults = KVEventsConfig()
    for name, value in raw.items():
        expected = type(getattr(defaults, name)) if name != "replay_endpoint" else str
        if name == "replay_endpoint" and value is None:
            continue
        # bool is an int in Python; the int fields take no booleans.
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise error(f"--kv-events-config: {name!r} must be {_TYPE_NAMES[expected]}, got {value!r}")
    config = KVEventsConfig(**raw)
    if config.publisher not in ("zmq", "null"):
        raise error(f"--kv-events-config: publisher must be 'zmq' or 'null', got {config.publisher!r}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 1:
            raise error(f"--kv-events-config: {name} must be >= 1")
    for name in ("endpoint", "replay_endpoint"):
        endpoint = getattr(config, name)
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise error(f"--kv-events-config: {name} must be a tcp://, ipc:// or inproc:// address")
    return config if config.enabled else None
