import ctypes
import ctypes.util

import psutil
import pytest

from radixserve.models import heap

CHUNK = 4096  # below glibc's mmap threshold: served from the heap, as a parser's allocations are
CHUNKS = 40_000  # ~160 MB


def test_freed_heap_pages_go_back_to_the_system() -> None:
    if heap._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    process = psutil.Process()
    chunks = [libc.malloc(CHUNK) for _ in range(CHUNKS)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, CHUNK)  # touched: resident
    pinned = libc.malloc(CHUNK)  # above them: free() alone cannot shrink the heap past it
    for chunk in chunks:
        libc.free(chunk)
    before = process.memory_info().rss
    heap.release_freed_heap()
    after = process.memory_info().rss
    libc.free(pinned)
    assert before - after > CHUNK * CHUNKS // 2
