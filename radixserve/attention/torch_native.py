"""torch_native: attention in plain torch (SDPA), on any device.

Extend: one SDPA call per request, with the shared-prefix cascade on a CPU (attention/extend.py);
on CUDA in fp16/bf16, one varlen flash-attention call per layer for the whole batch
(attention/varlen.py).
Decode: requests grouped into length buckets (attention/decode_buckets.py), one batched SDPA per
bucket and layer with GQA by grouping queries per K/V head; on a CPU, a prefix every request of a
bucket shares is attended once for all of them with torch's flash kernel and merged by
log-sum-exp, and each bucket's gathered K/V are kept between steps (decode staging,
attention/staging.py) when --decode-staging-tokens allows.

This is the reference the native backend is tested against, and the backend for CUDA until a
CUDA backend is registered.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from radixserve.attention.base import (
    AttentionBackend,
    AttentionBackendUnavailable,
    AttentionMetadata,
    AttentionSpec,
    ExtendMetadata,
    LayerInputs,
)
from radixserve.attention.common import merge_by_lse, stack_by_kv_head
from radixserve.attention.decode_buckets import DecodeBucket, build_buckets
from radixserve.attention.extend import extend_attention
from radixserve.attention.staging import DecodeStaging, StagedBucket, bucket_kv, shared_kv
from radixserve.attention.varlen import (
    VarlenExtendMetadata,
    plan_varlen_extend,
    varlen_extend_attention,
    varlen_flash_available,
)
from radixserve.forward.batch import DecodeLayout, ExtendSegment, ForwardMode

logger = logging.getLogger(__name__)


@dataclass
class TorchDecodeMetadata(AttentionMetadata):
    layout: DecodeLayout
    buckets: list[DecodeBucket]
    # Per bucket: its K/V kept between steps, or None (gathered from the pool every layer).
    staged: list[StagedBucket | None] = field(default_factory=list)


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    gathers_kv = True

    @classmethod
    def check_available(cls, spec: AttentionSpec) -> None:
        if spec.batch_invariant:
            # SDPA's splits and its bucketed batches depend on what else runs.
            raise AttentionBackendUnavailable(
                "batch-invariant inference (--enable-deterministic-inference) runs on cpu_native only"
            )

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        if spec.device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():  # type: ignore[no-untyped-call]
            # SDPA's cuDNN kernels are built (on the host) for each new shape; a decode step's
            # lengths are new at every step, so that build, not the GPU, set the step's time.
            # Flash and memory-efficient attention take any length as it comes.
            torch.backends.cuda.enable_cudnn_sdp(False)
            logger.info("attention: SDPA's cuDNN kernels off (they are rebuilt for every new length)")
        # The cascade needs the log-sum-exp that torch's CPU flash kernel returns. A sliding layer's
        # queries each see a different part of a shared prefix: with any, decode takes no cascade.
        self.cascade = spec.device.type == "cpu" and spec.sliding_window is None
        varlen_missing = varlen_flash_available(spec.device, spec.dtype, spec.head_dim)
        self.varlen_extend = varlen_missing is None
        if spec.device.type == "cuda":
            logger.info(
                "attention: extend %s",
                "as one varlen flash call per layer"
                if varlen_missing is None
                else f"one SDPA per request (no varlen flash: {varlen_missing})",
            )
        self.staging = DecodeStaging(
            max_tokens=spec.decode_staging_tokens,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            device=spec.device,
        )

    @property
    def decode_path(self) -> str:
        path = "torch SDPA over length buckets"
        if self.cascade:
            path += ", shared-prefix cascade (torch flash)"
        if self.staging.max_tokens:
            path += f", decode staging up to {self.staging.max_tokens} tokens"
        return path

    def plan_decode(self, layout: DecodeLayout) -> TorchDecodeMetadata:
        buckets = build_buckets(layout.req_to_token, layout.req_pool_indices, layout.seq_lens, self.cascade)
        staged: list[StagedBucket | None] = [None] * len(buckets)
        if self.staging.max_tokens:
            staged = self.staging.prepare(buckets, layout.request_ids)
        return TorchDecodeMetadata(ForwardMode.DECODE, layout, buckets, staged)

    def plan_extend(self, mode: ForwardMode, segments: list[ExtendSegment]) -> ExtendMetadata:
        if self.varlen_extend:
            plan = plan_varlen_extend(mode, segments, self.spec.device)
            if plan is not None:
                return plan
        return ExtendMetadata(mode, segments)

    def extend(self, x: LayerInputs, metadata: AttentionMetadata) -> torch.Tensor:
        if isinstance(metadata, VarlenExtendMetadata) and x.window is None:
            return varlen_extend_attention(x.q, x.k_cache, x.v_cache, metadata, x.scale)
        assert isinstance(metadata, ExtendMetadata)
        segments = metadata.segments
        return extend_attention(x.q, x.k, x.v, x.k_cache, x.v_cache, segments, x.scale, window=x.window)

    def decode(self, x: LayerInputs, metadata: AttentionMetadata) -> torch.Tensor:
        """q: [B, H, D], one query per request; k, v: [B, Hkv, D], the new tokens' (already in the
        pool). Returns [B, H, D]."""
        assert isinstance(metadata, TorchDecodeMetadata)
        buckets, staged = metadata.buckets, metadata.staged
        if len(buckets) == 1 and buckets[0].rows is None:
            return _bucket_attention(x, buckets[0], staged[0])
        out = torch.empty_like(x.q)
        for bucket, block in zip(buckets, staged, strict=True):
            assert bucket.rows is not None
            rows = bucket.rows
            part = dataclasses.replace(x, q=x.q[rows], k=x.k[rows], v=x.v[rows])
            out[rows] = _bucket_attention(part, bucket, block)
        return out

    def idle(self) -> None:
        self.staging.release()

    def stats(self) -> dict[str, Any]:
        # Decode buckets served from their staged K/V (appends) or refilled from the pool.
        return {
            "decode_staging_tokens": self.staging.max_tokens,
            "decode_staging_appends": self.staging.appends,
            "decode_staging_refills": self.staging.refills,
        }


def _bucket_attention(x: LayerInputs, bucket: DecodeBucket, staged: StagedBucket | None) -> torch.Tensor:
    keys, values = bucket_kv(bucket, staged, x.layer_id, x.k_cache, x.v_cache, x.k, x.v)
    if bucket.shared_slots is not None:
        if x.window is not None:
            raise RuntimeError(
                "a sliding-window layer reached a decode bucket planned with a shared prefix: the backend "
                "was built without the model's window (AttentionSpec.sliding_window)"
            )
        return _cascade_attention(x, keys, values, bucket, staged)
    mask = bucket.mask
    if x.window is not None:
        # Only the columns some row's window reaches; the mask leaves out the rest of each row.
        start, mask = bucket.window_view(x.window)
        keys, values = keys[:, :, start:], values[:, :, start:]
    size, heads, dim = x.q.shape
    kv_heads = x.k_cache.shape[1]
    # Queries grouped by their K/V head, [B, Hkv, G, D], as G query rows over the same keys: one
    # pass over each K/V head instead of one per query head (faster than enable_gqa here).
    grouped = x.q.view(size, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=x.scale)
    return out.reshape(size, heads, dim)


def _cascade_attention(
    x: LayerInputs,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    bucket: DecodeBucket,
    staged: StagedBucket | None,
) -> torch.Tensor:
    """Attention over shared prefix + own suffix, merged by log-sum-exp (CPU flash kernel)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    q, scale = x.q, x.scale
    size, heads, dim = q.shape
    kv_heads = x.k_cache.shape[1]
    group = heads // kv_heads
    # Queries grouped by their K/V head: [B, Hkv, G, D]. No GQA expansion is needed then.
    grouped = q.view(size, kv_heads, group, dim)

    # Shared part: every query of a K/V head attends to the same keys, one call for all requests.
    shared_k, shared_v = shared_kv(bucket, staged, x.layer_id, x.k_cache, x.v_cache)
    stacked = stack_by_kv_head(q, kv_heads)
    shared_out, shared_lse = flash(stacked, shared_k, shared_v, 0.0, False, scale=scale)
    shared_out = shared_out.view(kv_heads, size, group, dim).permute(1, 0, 2, 3)
    shared_lse = shared_lse.view(kv_heads, size, group).permute(1, 0, 2)

    # Each request's own part.
    mask = None
    if bucket.mask is not None:
        # This kernel takes an additive mask in the query's dtype.
        mask = torch.zeros(bucket.mask.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~bucket.mask, float("-inf"))
    own_out, own_lse = flash(grouped, own_k, own_v, 0.0, False, attn_mask=mask, scale=scale)

    return merge_by_lse(shared_out, shared_lse, own_out, own_lse).reshape(size, heads, dim)
