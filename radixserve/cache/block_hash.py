"""Page hashes: a chain over the radix tree's pages, the same for the same tokens in any process.

A page's hash covers its parent page's hash and its own token ids, so it names the whole prefix
up to and including the page (a content address). KV cache events name blocks by these hashes,
and a storage tier can key pages by them. 63 bits, so they stay non-negative in a signed 64-bit
field (msgpack, JSON consumers).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_MASK = (1 << 63) - 1


def page_hash(parent: int | None, tokens: Sequence[int]) -> int:
    digest = hashlib.blake2b(digest_size=8)
    # The root's children have no parent: -1 stands for it (a real hash is never negative).
    digest.update((-1 if parent is None else parent).to_bytes(8, "little", signed=True))
    digest.update(array("q", tokens).tobytes())
    return int.from_bytes(digest.digest(), "little") & _MASK


def page_hashes(parent: int | None, tokens: Sequence[int], page_size: int) -> list[int]:
    """The hashes of tokens' pages (len(tokens) a multiple of page_size), the first one's parent
    being `parent`."""
    hashes: list[int] = []
    for start in range(0, len(tokens), page_size):
        parent = page_hash(parent, tokens[start : start + page_size])
        hashes.append(parent)
    return hashes
