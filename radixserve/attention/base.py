"""The attention backend interface.

A backend computes attention over the paged KV pool. Once per forward, `plan(batch)` turns the
scheduler's ForwardBatch into the backend's own metadata (buckets, a shared prefix, staged K/V,
whatever its kernels need); then each layer calls `forward(...)` with that metadata. The backend
owns its metadata and any K/V it keeps between steps: the ForwardBatch stays what the scheduler
built.

Extension point: a new backend (a CUDA one on flashinfer or FlashAttention, say) subclasses
AttentionBackend, implements check_available / plan_decode / extend / decode (and plan_extend where
its extend needs more than the segments), and registers itself under its
--attention-backend name in attention/registry.py. VERIFY steps (speculative decoding's drafts)
run the extend math when every request's drafts are a chain, and a tree-masked attention
(attention/extend.py, tree_attention) when some are a tree, unless a backend overrides `verify`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from radixserve.attention.extend import tree_attention
from radixserve.cache.pools import KVCachePool
from radixserve.forward.batch import DecodeLayout, ExtendSegment, ForwardBatch, ForwardMode
from radixserve.kernels.cpu_ops import CpuKernels


class AttentionBackendUnavailable(RuntimeError):
    """This backend cannot run this model here; the message says why."""


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend is built for: one rank's share of the model's attention."""

    num_layers: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # K/V heads on this rank
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    # The native CPU kernels, when loaded (--cpu-kernels); None on torch ops only.
    kernels: CpuKernels | None
    # Decode staging budget in K/V tokens (attention/staging.py), for backends that gather K/V.
    decode_staging_tokens: int
    # --enable-deterministic-inference: every query's attention is computed in an order fixed by
    # its own context alone (no cascade over a prefix shared with other requests, no splits sized
    # from the batch, extend and decode through one kernel). Backends that cannot refuse it.
    batch_invariant: bool = False
    # The window of the model's sliding-window layers (ModelConfig.sliding_window), None where every
    # layer sees its whole context. Each such layer's calls carry it (LayerInputs.window); backends
    # that cannot honour it refuse the model.
    sliding_window: int | None = None


@dataclass
class LayerInputs:
    """One layer's attention inputs: the new tokens' q ([T, H, D]) and k, v ([T, Hkv, D], already
    written to the pool), and the layer's pool buffers ([slots, Hkv, D]). window: a sliding layer's
    window (a query at position p sees the keys at positions p - window < position <= p), None for a
    layer that sees its whole context."""

    layer_id: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    window: int | None = None


@dataclass
class AttentionMetadata:
    """What plan() worked out for one forward. Backends subclass it."""

    mode: ForwardMode


@dataclass
class ExtendMetadata(AttentionMetadata):
    """EXTEND and VERIFY: each request's segment of the batch (the builtin backends need no more)."""

    segments: list[ExtendSegment]


@dataclass
class TreeVerifyMetadata(ExtendMetadata):
    """A VERIFY step where some request's drafts form a tree: per request, which of its new tokens
    each new token sees (None: causal), as in ForwardBatch.verify_masks."""

    masks: list[torch.Tensor | None]


class AttentionBackend(ABC):
    name: ClassVar[str]
    # Whether decode gathers K/V out of the pool (and so may keep gathered copies between steps:
    # decode staging, counted in the KV memory budget).
    gathers_kv: ClassVar[bool] = False

    def __init__(self, spec: AttentionSpec):
        self.check_available(spec)
        self.spec = spec

    @classmethod
    def check_available(cls, spec: AttentionSpec) -> None:
        """Raises AttentionBackendUnavailable, with the reason, where this backend cannot run spec."""
        return None

    def plan(self, batch: ForwardBatch) -> AttentionMetadata:
        """Once per forward, before the first layer."""
        if batch.mode is ForwardMode.DECODE:
            assert batch.decode is not None
            return self.plan_decode(batch.decode)
        assert batch.extend is not None
        masks = batch.verify_masks
        if batch.mode is ForwardMode.VERIFY and masks is not None and any(m is not None for m in masks):
            return TreeVerifyMetadata(batch.mode, batch.extend, masks)
        return self.plan_extend(batch.mode, batch.extend)

    @abstractmethod
    def plan_decode(self, layout: DecodeLayout) -> AttentionMetadata:
        """A decode step's metadata (a backend keeps whatever it carries between steps here)."""

    def plan_extend(self, mode: ForwardMode, segments: list[ExtendSegment]) -> AttentionMetadata:
        return ExtendMetadata(mode, segments)

    @abstractmethod
    def extend(self, x: LayerInputs, metadata: AttentionMetadata) -> torch.Tensor:
        """Each new token sees its request's cached context and the request's new tokens up to
        itself. Returns [T, H, D]."""

    @abstractmethod
    def decode(self, x: LayerInputs, metadata: AttentionMetadata) -> torch.Tensor:
        """One query per request (q: [B, H, D]) over its whole context, its new token's included."""

    def verify(self, x: LayerInputs, metadata: AttentionMetadata) -> torch.Tensor:
        """Proposed tokens per request, each seeing its context and its ancestors among them: the
        extend math for chains, a masked attention for trees. A backend with a faster kernel
        overrides this."""
        if isinstance(metadata, TreeVerifyMetadata):
            return tree_attention(
                x.q, x.k, x.v, x.k_cache, x.v_cache, metadata.segments, metadata.masks, x.scale, x.window
            )
        return self.extend(x, metadata)

    def forward(self, x: LayerInputs, metadata: AttentionMetadata) -> torch.Tensor:
        if metadata.mode is ForwardMode.DECODE:
            return self.decode(x, metadata)
        if metadata.mode is ForwardMode.VERIFY:
            return self.verify(x, metadata)
        return self.extend(x, metadata)

    @property
    @abstractmethod
    def decode_path(self) -> str:
        """How a decode step's attention runs here, in a few words (logged, in /get_server_info)."""

    def idle(self) -> None:
        """Nothing runs: give back memory kept between steps."""
        return None

    def release(self) -> None:
        """The KV pool is being released: drop everything that points into it."""
        self.idle()

    def stats(self) -> dict[str, Any]:
        return {}


@dataclass
class WindowCall:
    """Where the sliding-window layers' K/V lie in window slots (cache/swa_pool.py): the metadata
    planned for the batch as they address it (forward/batch.py, window_view), and the window slot
    of each new token."""

    metadata: AttentionMetadata
    out_cache_loc: torch.Tensor


@dataclass
class AttentionCall:
    """One forward's attention, as the model's layers see it: the new tokens' K/V go into the
    pool, then the backend attends with the metadata it planned for this batch. A pool in another
    dtype than the activations (--kv-cache-dtype) has the backend work in the pool's: q, k and v
    are rounded to it, and the output comes back in the activations' dtype. window: how the
    sliding layers find their K/V where they lie in window slots (None: by the same slots)."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_pool: KVCachePool
    out_cache_loc: torch.Tensor  # the KV slot of each new token
    window: WindowCall | None = None

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """window: the layer's sliding window, None where it sees its whole context."""
        activations = q.dtype
        if self.kv_pool.dtype != activations:
            q, k, v = (t.to(self.kv_pool.dtype) for t in (q, k, v))
        metadata, slots = self.metadata, self.out_cache_loc
        if window is not None and self.window is not None:
            metadata, slots = self.window.metadata, self.window.out_cache_loc
        self.kv_pool.write(layer_id, slots, k, v)
        k_cache, v_cache = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        inputs = LayerInputs(layer_id, q, k, v, k_cache, v_cache, scale, window)
        return self.backend.forward(inputs, metadata).to(activations)
