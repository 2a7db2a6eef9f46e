"""Handing the heap memory a load freed back to the operating system.

Parsing a large file leaves its transient structures freed but resident: glibc keeps freed chunks
that sit below live allocations in its arenas, so the process's RSS stays at the parse's peak.
A tokenizer is the worst case: the `tokenizers` library parses tokenizer.json (for a 262k-token
vocabulary, half a million merges) into temporary structures two to three times the size of the
tokenizer it builds from them. malloc_trim(0) returns every free page of every arena, so it is
called once after such a load; with a C library that has no malloc_trim it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

logger = logging.getLogger("radixserve")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        logger.info("this C library has no malloc_trim: memory freed after loads stays with the process")
        return None
    return trim


def release_freed_heap() -> None:
    """Returns the free pages of the C heap to the operating system (glibc's malloc_trim(0))."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
