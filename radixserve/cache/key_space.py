"""Cache keys for K/V that only some requests may share: a LoRA adapter's requests compute other
K/V for the same tokens, so their prompts are keyed in the adapter's namespace, token ids shifted
by it. The radix tree, the storage tier's page hashes and KV events all see the shifted keys, so
nothing of one namespace ever matches another's; events split them back (lora_id, token ids)."""

from __future__ import annotations

from collections.abc import Sequence

# Token ids (and the stand-in ids of prompts given as vectors) stay below 2^32; a namespace below
# 2^30 keeps every key inside the signed 64-bit integers the page hashes pack them as.
_SHIFT = 32
_NAMESPACES = 1 << 30
_TOKEN_MASK = (1 << _SHIFT) - 1


def namespace_of(fingerprint: str) -> int:
    """A namespace (never 0, the base model's) from a hex digest: the same in every process."""
    return (int(fingerprint[:16], 16) % (_NAMESPACES - 1)) + 1


def namespaced(ids: list[int], namespace: int) -> list[int]:
    if namespace == 0:
        return ids
    offset = namespace << _SHIFT
    return [t + offset for t in ids]


def split_namespace(keys: Sequence[int]) -> tuple[int, list[int]]:
    """(namespace, token ids) of keys that namespaced() made (one namespace per sequence)."""
    if not keys or keys[0] <= _TOKEN_MASK:
        return 0, list(keys)
    return keys[0] >> _SHIFT, [k & _TOKEN_MASK for k in keys]
