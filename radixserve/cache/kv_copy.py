"""K/V copies between the device pool and host memory that do not hold up the thread that starts
them: the hierarchical cache's L2 writes (device -> host) and loads (host -> device).

On a CUDA device a copy runs on a stream of its own, so it overlaps the model's forwards:
- `download` is started on the scheduler's thread right after the K/V were gathered (the slots may
  be reused by the next forward, so the gather itself stays on the forward's stream, ordered before
  it). Its copy into pinned host memory waits for the gather alone; the tier's I/O thread waits for
  the copy (`KVCopy.wait`) before it stores the pages.
- `upload` is started on the I/O thread once a load's pages are read. The scheduler's thread, when
  it installs the load, makes its own stream wait for the copy (no host wait at all) and scatters
  the K/V into the pool from device memory.

On a CPU the device pool is host memory: both are plain tensors, ready at once.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class KVCopy(ABC):
    @abstractmethod
    def wait(self) -> torch.Tensor:
        """The copied K/V, once they may be read on the calling thread (host memory after a
        download; for an upload, device memory the calling thread's stream may read)."""


@dataclass
class ReadyKV(KVCopy):
    """A copy already done (every copy on a CPU)."""

    kv: torch.Tensor

    def wait(self) -> torch.Tensor:
        return self.kv


@dataclass
class _PendingDownload(KVCopy):
    host: torch.Tensor  # pinned
    done: torch.cuda.Event

    def wait(self) -> torch.Tensor:
        self.done.synchronize()
        return self.host


@dataclass
class _PendingUpload(KVCopy):
    device_kv: torch.Tensor
    done: torch.cuda.Event

    def wait(self) -> torch.Tensor:
        stream = torch.cuda.current_stream(self.device_kv.device)
        stream.wait_event(self.done)
        # Freed after this stream's use of it, not when the copy stream last touched it.
        self.device_kv.record_stream(stream)
        return self.device_kv


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the K/V copies for a CUDA device run on (one per device)."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    return _copy_stream(device)


def copies_issued(device: torch.device) -> torch.cuda.Event:
    """Completes once every copy issued so far for `device` has: a host page they read may then
    be written again."""
    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    event.record(copy_stream(device))
    return event


class HostDeviceCopier:
    """Starts K/V copies for a pool on `device` (one per executor; the copy stream is its own)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = copy_stream(device) if device.type == "cuda" else None

    @property
    def pins(self) -> bool:
        """Host pages meant for this device are best kept pinned (their copies are then async)."""
        return self._stream is not None

    def download(self, device_kv: torch.Tensor) -> KVCopy:
        """device_kv (just made on the calling thread's stream, not to be written to again) into
        host memory."""
        if self._stream is None:
            return ReadyKV(device_kv)
        made_on = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(made_on)
        with torch.cuda.stream(self._stream):
            host = torch.empty(device_kv.shape, dtype=device_kv.dtype, pin_memory=True)
            host.copy_(device_kv, non_blocking=True)
            # Waited for on the I/O thread: blocking, so it sleeps instead of spinning on a core
            # (and on the driver) while the scheduler's thread launches the forwards.
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            done.record(self._stream)
        device_kv.record_stream(self._stream)
        return _PendingDownload(host, done)

    def upload(self, pages: list[torch.Tensor]) -> KVCopy:
        """Host pages [layers, 2, tokens, heads, head_dim] joined along the tokens into device
        memory. Pinned pages must stay unchanged until the copy is done (the host pool never writes a
        page it holds, and reuses one it dropped only after copies_issued)."""
        if self._stream is None:
            return ReadyKV(torch.cat(pages, dim=2) if len(pages) > 1 else pages[0])
        first = pages[0]
        shape = (*first.shape[:2], sum(page.shape[2] for page in pages), *first.shape[3:])
        with torch.cuda.stream(self._stream):
            device_kv = torch.empty(shape, dtype=first.dtype, device=self.device)
            start = 0
            for page in pages:
                end = start + page.shape[2]
                device_kv[:, :, start:end].copy_(page, non_blocking=True)
                start = end
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
        return _PendingUpload(device_kv, done)
