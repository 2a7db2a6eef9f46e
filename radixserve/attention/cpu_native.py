"""cpu_native: attention on the native CPU kernels (radixserve/kernels).

Decode reads each request's K/V in place from the paged pool through req_to_token (no gather, no
padding to buckets, no staging copy). When every request of the batch starts with the same KV
slots, all queries attend to that prefix in one GEMM-shaped call per layer (on AMX tiles where the
CPU has them, else a native vector kernel), the prefix's K/V kept contiguous between steps
(PrefixStaging), and the kernel merges it in by log-sum-exp. Extend runs the cascade of
attention/extend.py with the native merge, the native prefix kernel (AMX tiles or vector FMAs) for
its shared part in bf16, and on AMX the native causal kernel for single requests. A sliding
layer's decode reads each request's window from the pool (the kernel skips the positions before
it, so no shared-prefix cascade there), its extend the masked attention of attention/extend.py.

Which kernels run is decided here once, at startup, from the CPU and the model's head shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixserve.attention.base import (
    AttentionBackend,
    AttentionBackendUnavailable,
    AttentionMetadata,
    AttentionSpec,
    ExtendMetadata,
    LayerInputs,
)
from radixserve.attention.common import decode_shared_prefix, stack_by_kv_head
from radixserve.attention.extend import CpuAttentionOps, extend_attention
from radixserve.attention.staging import PrefixStaging, StagedPrefix
from radixserve.forward.batch import DecodeLayout, ExtendSegment, ForwardBatch, ForwardMode
from radixserve.kernels.cpu_ops import SharedPrefixResult

# Batch-invariant mode: contexts are cut into pieces of this many positions from position 0
# (set_decode_fixed_pieces, kernels/csrc/decode_attention.cpp): small enough that one long request still
# spreads over the cores, large enough that merging its pieces costs little.
INVARIANT_PIECE_TOKENS = 128
# Batch-invariant extend hands its queries to the decode kernel in calls of at most this many rows
# (the kernel's scratch grows with the rows of a call).
INVARIANT_EXTEND_ROWS = 1024
# What the decode path line says the shared prefix runs on (CpuKernels.prefix_attention_kernel).
_PREFIX_KERNEL_NAMES = {"amx": "AMX tiles", "vector": "native vector kernel", None: "torch flash"}


@dataclass
class InvariantExtendMetadata(ExtendMetadata):
    """Batch-invariant extend: every new token is one decode query over its own causal context,
    so it is computed exactly as it would be in a decode step, in any batch, chunk or cache state."""

    table: torch.Tensor  # [segments, longest context]: each segment's context KV slots
    rows: torch.Tensor  # [T]: the table row of each new token
    lens: torch.Tensor  # [T]: each new token's context length (its position + 1)


@dataclass
class CpuDecodeMetadata(AttentionMetadata):
    layout: DecodeLayout
    # The KV slots every request's context starts with (cascade), or None.
    shared_prefix: torch.Tensor | None
    # Their K/V kept between steps, or None (gathered per layer).
    staged_prefix: StagedPrefix | None


class CpuNativeBackend(AttentionBackend):
    name = "cpu_native"

    @classmethod
    def check_available(cls, spec: AttentionSpec) -> None:
        kernels = spec.kernels
        if spec.device.type != "cpu" or kernels is None:
            raise AttentionBackendUnavailable(
                "cpu_native needs the native CPU kernels on a CPU (--cpu-kernels auto or native)"
            )
        if not kernels.handles_decode_attention(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype):
            per_kv = spec.num_heads // max(spec.num_kv_heads, 1)
            raise AttentionBackendUnavailable(
                f"no native decode kernel for head_dim {spec.head_dim} with {per_kv} query heads per "
                f"K/V head in {spec.dtype}"
            )

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        kernels = spec.kernels
        assert kernels is not None
        prefix_kernel = None
        if spec.dtype == torch.bfloat16:
            prefix_kernel = kernels.prefix_attention_kernel(spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self.ops = CpuAttentionOps(kernels, prefix_kernel)
        self.batch_invariant = spec.batch_invariant
        kernels.set_decode_fixed_pieces(INVARIANT_PIECE_TOKENS if spec.batch_invariant else 0)
        self.prefix_staging = PrefixStaging(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device
        )
        # Set by the model runner when decode steps run in the fused native loop, which (with a native
        # prefix kernel: fused_shared_prefix) reads the shared prefix from the pool by its slots:
        # staging it would be a copy nobody reads. Else steps with a shared prefix run per layer, staged.
        self.fused_decode = False
        self.fused_shared_prefix = False

    @property
    def decode_path(self) -> str:
        prefix = _PREFIX_KERNEL_NAMES[self.ops.prefix_kernel]
        path = f"native paged decode kernel, shared-prefix cascade on {prefix}"
        if self.batch_invariant:
            path = (
                f"batch-invariant: native paged decode kernel in {INVARIANT_PIECE_TOKENS}-token pieces, "
                "no cascade; extend through the same kernel"
            )
        if self.fused_decode and (self.fused_shared_prefix or self.batch_invariant):
            # Batch-invariant steps have no shared prefix: every one of them runs fused.
            path = f"fused native decode loop (every layer in one call): {path}"
        elif self.fused_decode:
            loop = "fused native decode loop (every layer in one call; steps with a shared prefix per layer)"
            path = f"{loop}: {path}"
        return path

    def plan(self, batch: ForwardBatch) -> AttentionMetadata:
        if batch.mode is ForwardMode.VERIFY and self.fused_decode:
            # Every draft token is a decode query over its request's context and its own ancestors
            # (in a chain: every token before it), so the verify step runs as a decode step of one
            # row per token, in the fused loop like any decode step (the K/V of a layer's rows are
            # all written before its attention reads them). No shared prefix: a request's rows
            # share all but their ends.
            assert batch.extend is not None
            layout = verify_decode_layout(batch.extend, batch.verify_masks)
            return CpuDecodeMetadata(ForwardMode.DECODE, layout, None, None)
        return super().plan(batch)

    def plan_decode(self, layout: DecodeLayout) -> CpuDecodeMetadata:
        if self.batch_invariant:
            # A prefix shared with the others would change how this request's sums are split.
            return CpuDecodeMetadata(ForwardMode.DECODE, layout, None, None)
        shared = decode_shared_prefix(layout)
        staged = None
        if not (self.fused_decode and self.fused_shared_prefix):
            staged = self.prefix_staging.prepare(shared, layout.request_ids)
        return CpuDecodeMetadata(ForwardMode.DECODE, layout, shared, staged)

    def plan_window(self, batch: ForwardBatch) -> AttentionMetadata:
        """The metadata of the sliding-window layers over their window slots (batch: the forward's
        window_view). Their decode reads each request's window alone, so it shares no prefix."""
        if batch.mode is ForwardMode.DECODE:
            assert batch.decode is not None
            return CpuDecodeMetadata(ForwardMode.DECODE, batch.decode, None, None)
        return self.plan(batch)

    def plan_extend(self, mode: ForwardMode, segments: list[ExtendSegment]) -> ExtendMetadata:
        if not self.batch_invariant:
            return ExtendMetadata(mode, segments)
        if any(seg.context_slots is None for seg in segments):
            raise ValueError("batch-invariant extend reads K/V through each segment's context_slots")
        longest = max(seg.prefix_len + seg.q_len for seg in segments)
        table = torch.zeros((len(segments), longest), dtype=torch.int64)
        for index, seg in enumerate(segments):
            assert seg.context_slots is not None
            table[index, : seg.prefix_len + seg.q_len] = seg.context_slots
        q_lens = torch.tensor([seg.q_len for seg in segments])
        rows = torch.repeat_interleave(torch.arange(len(segments)), q_lens)
        lens = torch.cat([torch.arange(s.prefix_len + 1, s.prefix_len + s.q_len + 1) for s in segments])
        return InvariantExtendMetadata(mode, segments, table, rows, lens)

    def extend(self, x: LayerInputs, metadata: AttentionMetadata) -> torch.Tensor:
        if isinstance(metadata, InvariantExtendMetadata):
            return self._invariant_extend(x, metadata)
        assert isinstance(metadata, ExtendMetadata)
        return extend_attention(
            x.q, x.k, x.v, x.k_cache, x.v_cache, metadata.segments, x.scale, self.ops, x.window
        )

    def _invariant_extend(self, x: LayerInputs, metadata: InvariantExtendMetadata) -> torch.Tensor:
        parts = []
        for start in range(0, x.q.shape[0], INVARIANT_EXTEND_ROWS):
            end = start + INVARIANT_EXTEND_ROWS
            out = self.ops.kernels.decode_attention(
                x.q[start:end], x.k_cache, x.v_cache, metadata.table, metadata.rows[start:end],
                metadata.lens[start:end], x.scale, window=x.window,
            )  # fmt: skip
            if out is None:
                raise RuntimeError("the native decode attention kernel declined its inputs (see the log)")
            parts.append(out)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def decode(self, x: LayerInputs, metadata: AttentionMetadata) -> torch.Tensor:
        assert isinstance(metadata, CpuDecodeMetadata)
        layout = metadata.layout
        # A sliding layer reads each request's window alone: the shared prefix may lie outside it.
        shared = metadata.shared_prefix is not None and x.window is None
        prefix = self._shared_prefix_attention(x, metadata) if shared else None
        out = self.ops.kernels.decode_attention(
            x.q, x.k_cache, x.v_cache, layout.req_to_token, layout.req_pool_indices, layout.seq_lens, x.scale,
            prefix, x.window,
        )  # fmt: skip
        if out is None:
            # The shape was checked at startup; a decline here means inputs it was not built for.
            raise RuntimeError("the native decode attention kernel declined its inputs (see the log)")
        return out

    def _shared_prefix_attention(self, x: LayerInputs, metadata: CpuDecodeMetadata) -> SharedPrefixResult:
        """Every query of the batch over the prefix all requests share, in one call per K/V head
        group: the prefix is read once instead of once per request, and the call is GEMM-shaped.
        The decode kernel attends the rest and merges this in by log-sum-exp."""
        slots = metadata.shared_prefix
        assert slots is not None
        if metadata.staged_prefix is not None:
            keys, values = metadata.staged_prefix.layer_kv(x.layer_id, x.k_cache, x.v_cache)
        else:
            keys, values = x.k_cache.index_select(0, slots), x.v_cache.index_select(0, slots)
        if self.ops.prefix_kernel is not None:
            native = self.ops.kernels.prefix_attention(x.q, keys, values, x.scale, self.ops.prefix_kernel)
            if native is not None:
                return native
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        stacked = stack_by_kv_head(x.q, x.k_cache.shape[1])
        keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        out, lse = flash(stacked, keys, values, 0.0, False, scale=x.scale)
        return SharedPrefixResult(int(slots.shape[0]), out[0], lse[0].contiguous())

    def idle(self) -> None:
        self.prefix_staging.release()

    def stats(self) -> dict[str, Any]:
        return {"decode_staging_tokens": 0, "decode_staging_appends": 0, "decode_staging_refills": 0}


def verify_decode_layout(
    segments: list[ExtendSegment], masks: list[torch.Tensor | None] | None
) -> DecodeLayout:
    """A verify step as decode rows. For a chain (mask None), row j of a segment attends to its
    first prefix_len + j + 1 context slots: one table row per segment, shared by its rows. For a
    tree, each node gets a table row of its own: the context, then the slots of its ancestors and
    itself in tree order (the keys the tree mask lets it see, in position order)."""
    width = max(seg.prefix_len + seg.q_len for seg in segments)
    tables: list[torch.Tensor] = []
    rows: list[int] = []
    lens: list[int] = []
    for index, seg in enumerate(segments):
        slots = seg.context_slots
        assert slots is not None
        mask = None if masks is None else masks[index]
        if mask is None:
            rows += [len(tables)] * seg.q_len
            lens += range(seg.prefix_len + 1, seg.prefix_len + seg.q_len + 1)
            tables.append(torch.zeros(width, dtype=torch.int64))
            tables[-1][: seg.prefix_len + seg.q_len] = slots
            continue
        new_slots = slots[seg.prefix_len :]
        for node in range(seg.q_len):
            seen = new_slots[mask[node]]
            row = torch.zeros(width, dtype=torch.int64)
            row[: seg.prefix_len] = slots[: seg.prefix_len]
            row[seg.prefix_len : seg.prefix_len + seen.shape[0]] = seen
            rows.append(len(tables))
            lens.append(seg.prefix_len + int(seen.shape[0]))
            tables.append(row)
    return DecodeLayout(torch.stack(tables), torch.tensor(rows), torch.tensor(lens), request_ids=rows)
