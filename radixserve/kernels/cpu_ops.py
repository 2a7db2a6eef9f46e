"""Tensor-level entry points of the native CPU kernels: tensors in, tensors out.

Whether the kernels are used at all is decided once, at startup (select_cpu_kernels,
--cpu-kernels). Each op then returns None (or False) for an input it does not handle (another
device or dtype, a memory layout the kernel cannot address, a head shape without a compiled
kernel), and the caller runs its torch code instead. Such a decline is never silent: it is counted
per op (CpuKernels.fallbacks, in /get_server_info as kernel_fallbacks) and logged the first time
for each op and input signature.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from radixserve.kernels.native import (
    DTYPE_SUFFIXES,
    NativeKernelsUnavailable,
    check_isa,
    isa_of,
    load_isa,
    load_library,
)
from radixserve.kernels.quant_ops import QuantKernels

logger = logging.getLogger(__name__)

# The AMX attention kernels (csrc/amx_attention.cpp) are compiled for head dims that are multiples of
# 32, up to this.
AMX_MAX_HEAD_DIM = 256
# bf16_linear_isa()'s values (csrc/bf16_linear.cpp) by name; 0: the build has no such kernel.
_LINEAR_ISAS = {4: "avx512_bf16", 2: "avx512", 1: "avx2"}


@dataclass
class SharedPrefixResult:
    """Attention of every decode query over the context prefix all requests share, computed
    beforehand: out is [Hkv, B * G, D] (row b * G + g: request b's query g of that K/V head, last
    dimension contiguous), lse the matching natural-log log-sum-exp, [Hkv, B * G] fp32."""

    length: int
    out: torch.Tensor
    lse: torch.Tensor


@dataclass(frozen=True)
class ExpertShape:
    """The Mixture-of-Experts layers of a fused decode loop: experts per layer, experts per token,
    whether their weights are renormalized to sum to 1, each expert's intermediate size, and the
    shared expert's (0: none)."""

    experts: int
    top_k: int
    normalize: bool
    intermediate: int
    shared_intermediate: int = 0

    def as_args(self) -> tuple[int, int, int, int, int]:
        return self.experts, self.top_k, int(self.normalize), self.intermediate, self.shared_intermediate


class FusedFlavor(enum.IntFlag):
    """What a model's layers run in the fused decode loop besides Llama's (fused_decode.cpp, Flavor):
    norms scaled by 1 + weight and GELU-tanh (Gemma's), q/k norms over whole projections (OLMoE's)."""

    LLAMA = 0
    UNIT_OFFSET_NORMS = 1
    GELU_TANH = 2
    FULL_WIDTH_QK_NORMS = 4


_Op = TypeVar("_Op", bound=Callable[..., Any])


def _counted(op: _Op) -> _Op:
    """Counts and logs the op's declines (a None or False result)."""

    @functools.wraps(op)
    def run(self: CpuKernels, *args: Any, **kwargs: Any) -> Any:
        result = op(self, *args, **kwargs)
        if result is None or result is False:
            self.declined(op.__name__, args)
        return result

    return run  # type: ignore[return-value]


def _signature(args: tuple[Any, ...]) -> str:
    parts = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            parts.append(f"{arg.dtype} {tuple(arg.shape)} strides {arg.stride()} on {arg.device}")
    return "; ".join(parts)


class CpuKernels:
    def __init__(self, library: ctypes.CDLL):
        # Declined inputs per op (the torch code ran instead), and the signatures logged so far.
        self.fallbacks: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._functions: dict[tuple[str, torch.dtype], Callable[..., Any]] = {
            (name, dtype): getattr(library, f"{name}_{suffix}")
            for name in (
                "rms_norm",
                "silu_and_mul",
                "gelu_tanh_and_mul",
                "rotary",
                "merge_by_lse",
                "decode_attention",
                "fused_decode",
            )
            for dtype, suffix in DTYPE_SUFFIXES.items()
        }
        self._decode_supported = library.decode_attention_supported
        self._set_decode_fixed_pieces = library.set_decode_fixed_pieces
        self.decode_fixed_pieces = 0
        self._fused_decode_f32_kv_bf16 = library.fused_decode_f32_kv_bf16
        self._amx_linear = library.amx_linear_bf16
        self._bf16_linear = library.bf16_linear
        self._fp32_linear = library.fp32_linear
        self._amx_prefix_attention = library.amx_prefix_attention_bf16
        self._vector_prefix_attention = library.prefix_attention_bf16
        self._argmax_rows = library.argmax_rows_f32
        # GGUF block-quantized weights (csrc/quant_linear.cpp); None where the build has no kernel.
        quant = QuantKernels(library)
        self.quant: QuantKernels | None = quant if quant.available else None
        # Whether this build has the AMX matmul and the OS grants this process AMX tiles.
        self.has_amx_linear = bool(library.amx_linear_available())
        # What the kernels run on (RADIXSERVE_CPU_ISA may force less than the CPU has).
        self.isa = isa_of(library)
        # The bf16 linear kernel of this process, chosen once: the AMX matmul where it runs, else
        # csrc/bf16_linear.cpp where the build has AVX2 + FMA or more, else none (oneDNN or F.linear).
        linear_isa = _LINEAR_ISAS.get(library.bf16_linear_isa())
        self.linear_kernel: str | None = (
            "amx" if self.has_amx_linear else None if linear_isa is None else f"native_{linear_isa}"
        )

    def declined(self, op: str, args: tuple[Any, ...]) -> None:
        self.fallbacks[op] += 1
        signature = _signature(args)
        if (op, signature) not in self._logged:
            self._logged.add((op, signature))
            logger.info("native %s declined [%s]; its torch code ran instead", op, signature)

    def handles_decode_attention(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether decode_attention has a kernel for this head shape and dtype."""
        return (
            dtype in DTYPE_SUFFIXES
            and kv_heads > 0
            and heads % kv_heads == 0
            and bool(self._decode_supported(heads // kv_heads, head_dim))
        )

    def prefix_attention_kernel(self, heads: int, kv_heads: int, head_dim: int) -> str | None:
        """Which native kernel prefix_attention runs for this head shape (bf16): "amx" (tiles; a
        head_dim a multiple of 32 up to 256), "vector" (fp32 FMAs on any x86-64 CPU; a multiple of
        16), or None. A function of the shape only, so the per-layer path and the fused decode loop
        always pick the same one."""
        if kv_heads <= 0 or heads % kv_heads:
            return None
        if self.has_amx_linear and head_dim % 32 == 0 and head_dim <= AMX_MAX_HEAD_DIM:
            return "amx"
        return "vector" if head_dim % 16 == 0 and head_dim > 0 else None

    def set_decode_fixed_pieces(self, tokens: int) -> None:
        """Batch-invariant decode attention: contexts split into pieces of exactly `tokens`
        positions from position 0 (0: pieces sized from the batch, the default). Process-wide."""
        self._set_decode_fixed_pieces(tokens)
        self.decode_fixed_pieces = max(tokens, 0)

    def _function(self, name: str, x: torch.Tensor) -> Callable[..., Any] | None:
        if x.device.type != "cpu":
            return None
        return self._functions.get((name, x.dtype))

    @_counted
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
    ) -> torch.Tensor | None:
        """RMSNorm of the rows of a 2-D x, normalized in fp32 and scaled in x's dtype; with
        unit_offset (Gemma's), scaled by 1 + weight in fp32 and rounded once."""
        run = self._function("rms_norm", x)
        if run is None or x.dim() != 2 or x.stride(1) != 1 or weight.dtype != x.dtype:
            return None
        weight = weight.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        run(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
            int(unit_offset))  # fmt: skip
        return out

    @_counted
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for x = [gate | up] on its last dimension (2-D)."""
        return self._gated("silu_and_mul", x)

    @_counted
    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """gelu(gate, approximate="tanh") * up for x = [gate | up] on its last dimension (2-D)."""
        return self._gated("gelu_tanh_and_mul", x)

    def _gated(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        run = self._function(name, x)
        if run is None or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % 2:
            return None
        rows, size = x.shape[0], x.shape[1] // 2
        out = torch.empty((rows, size), dtype=x.dtype)
        run(x.data_ptr(), x.stride(0), out.data_ptr(), rows, size)
        return out

    @_counted
    def rotary_(
        self, x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor
    ) -> bool:
        """Rotates x ([tokens, heads, dim], half-split layout) in place; False if it did not. The
        tables' width (rotary_dim / 2) may cover fewer dimensions than a head (a partial rotary
        factor): each head's first rotary_dim turn."""
        run = self._function("rotary", x)
        rotary_dim = 2 * cos_table.shape[-1]
        if (
            run is None
            or not _rows_of_packed_heads(x)
            or rotary_dim > x.shape[-1]
            or positions.dtype != torch.int64
            or not positions.is_contiguous()
            or cos_table.dtype != torch.float32
            or not (cos_table.is_contiguous() and sin_table.is_contiguous())
        ):
            return False
        tokens, heads, dim = x.shape
        run(x.data_ptr(), x.stride(0), tokens, heads, dim, rotary_dim, cos_table.data_ptr(),
            sin_table.data_ptr(), positions.data_ptr())  # fmt: skip
        return True

    @_counted
    def merge_by_lse(
        self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> torch.Tensor | None:
        """Attention over the union of two key sets from each set's output ([N, A, B, D], any
        strides but a contiguous last dimension) and natural-log log-sum-exp ([N, A, B], fp32).
        Returns [N, A * B, D] in out_a's dtype."""
        run = self._function("merge_by_lse", out_a)
        if (
            run is None
            or out_a.dim() != 4
            or out_b.shape != out_a.shape
            or out_b.dtype != out_a.dtype
            or lse_a.shape != out_a.shape[:3]
            or lse_b.shape != out_a.shape[:3]
            or lse_a.dtype != torch.float32
            or lse_b.dtype != torch.float32
            or out_a.stride(3) != 1
            or out_b.stride(3) != 1
        ):
            return None
        n, na, nb, dim = out_a.shape
        out = torch.empty((n, na * nb, dim), dtype=out_a.dtype)
        run(out_a.data_ptr(), *out_a.stride()[:3], lse_a.data_ptr(), *lse_a.stride(),
            out_b.data_ptr(), *out_b.stride()[:3], lse_b.data_ptr(), *lse_b.stride(),
            out.data_ptr(), n, na, nb, dim)  # fmt: skip
        return out

    @_counted
    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        prefix: SharedPrefixResult | None = None,
        window: int | None = None,
    ) -> torch.Tensor | None:
        """One query per request (q: [B, H, D]) over its context, read in place from the paged pool:
        request b's K/V are at slots req_to_token[req_pool_indices[b], :seq_lens[b]]. With prefix,
        the kernel reads only the positions after it and merges its result in. With a sliding
        window w, request b attends its last w positions only (no prefix with a window)."""
        run = self._function("decode_attention", q)
        if (
            run is None
            or (window is not None and (window < 1 or prefix is not None))
            or not _rows_of_packed_heads(q)
            or k_cache.dtype != q.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or req_to_token.dtype != torch.int64
            or req_to_token.stride(1) != 1
        ):
            return None
        length, prefix_out, head_stride, row_stride, prefix_lse = 0, 0, 0, 0, 0
        if prefix is not None:
            if prefix.out.dtype != q.dtype or prefix.out.stride(2) != 1 or not prefix.lse.is_contiguous():
                return None
            length, prefix_out, prefix_lse = prefix.length, prefix.out.data_ptr(), prefix.lse.data_ptr()
            head_stride, row_stride = prefix.out.stride(0), prefix.out.stride(1)
        rows = req_pool_indices.to(torch.int64).contiguous()
        lens = seq_lens.to(torch.int64).contiguous()
        batch, heads, dim = q.shape
        out = torch.empty((batch, heads, dim), dtype=q.dtype)
        table = req_to_token
        status = run(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                     table.stride(0), rows.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, heads,
                     k_cache.shape[1], dim, scale, length, prefix_out, head_stride, row_stride,
                     prefix_lse, window or 0)  # fmt: skip
        return out if status == 0 else None

    @_counted
    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """x.max(dim=-1).indices for a 2-D fp32 x (the first maximum; a NaN counts as the maximum),
        in one pass over x."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
            return None
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0] and x.shape[1]:
            self._argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
        return out if x.shape[1] else None

    @_counted
    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A linear weight [N, K] in the layout of this process's linear kernel, or None where it
        cannot run it: no native linear kernel here, not bf16 on a CPU, or a shape it does not take
        (AMX: N and K multiples of 32; csrc/bf16_linear.cpp: N a multiple of 16, K of 2)."""
        if self.linear_kernel is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            return None
        if weight.dim() != 2 or 0 in weight.shape:
            return None
        n, k = weight.shape
        if self.has_amx_linear:
            if n % 32 or k % 32:
                return None
            # [N/32 column blocks][K/32 steps][2 tiles][16 input pairs][16 columns][2 inputs of a pair]
            return weight.reshape(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
        if n % 16 or k % 2:
            return None
        # [N/16 column blocks][K/2 input pairs][16 columns][2 inputs of a pair]
        return weight.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    @staticmethod
    def unpack_linear(packed: torch.Tensor) -> torch.Tensor:
        """The [N, K] weight pack_linear made `packed` from (either layout: 6-D AMX, 4-D otherwise)."""
        if packed.dim() == 4:
            blocks, pairs = packed.shape[:2]
            return packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)
        blocks, steps = packed.shape[:2]
        return packed.permute(0, 2, 4, 1, 3, 5).reshape(blocks * 32, steps * 32)

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] W^T (+ bias) (+ residual, added to the fp32 sum before rounding) for a weight
        from pack_linear; bf16 in and out."""
        amx = packed.dim() == 6
        run = self._amx_linear if amx else self._bf16_linear
        n, k = (
            (packed.shape[0] * 32, packed.shape[1] * 32)
            if amx
            else (packed.shape[0] * 16, packed.shape[1] * 2)
        )
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"expected bf16 input of shape [rows, {k}], got {x.dtype} {tuple(x.shape)}")
        rows = x.shape[0]
        if x.stride(1) != 1 or x.stride(0) < k:
            x = x.contiguous()
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        if residual is not None and (residual.stride(1) != 1 or residual.dtype != torch.bfloat16):
            residual = residual.to(torch.bfloat16).contiguous()
        out = torch.empty((rows, n), dtype=torch.bfloat16)
        if rows:
            run(x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), n,
                None if bias is None else bias.data_ptr(),
                None if residual is None else residual.data_ptr(),
                0 if residual is None else residual.stride(0), rows, n, k)  # fmt: skip
        return out

    def fp32_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] W^T (+ bias) in fp32 for W [N, K] as torch holds it (csrc/fp32_linear.cpp): for
        the few rows of a decode step, where it streams the weights faster than F.linear."""
        if x.dtype != torch.float32 or x.dim() != 2 or weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(
                f"expected fp32 [rows, k] and [n, k], got {x.dtype} {tuple(x.shape)}, {weight.dtype}"
            )
        n, k = weight.shape
        if x.shape[1] != k or not weight.is_contiguous():
            raise ValueError(f"expected input [rows, {k}] and a contiguous weight")
        if x.stride(1) != 1:
            x = x.contiguous()
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, n), dtype=torch.float32)
        if rows:
            self._fp32_linear(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), n,
                              None if bias is None else bias.data_ptr(), rows, n, k)  # fmt: skip
        return out

    def _attention_inputs_fit(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """What the native attention entry points need: bf16 on a CPU, queries as rows of packed
        heads, keys and values alike ([*, Hkv, D]) with Hkv dividing the query heads."""
        if q.dtype != torch.bfloat16 or q.device.type != "cpu":
            return False
        if keys.dtype != q.dtype or values.dtype != q.dtype or keys.dim() != 3 or keys.shape != values.shape:
            return False
        kv_heads = keys.shape[1]
        return (
            _rows_of_packed_heads(q)
            and keys.shape[2] == q.shape[2]
            and kv_heads > 0
            and q.shape[1] % kv_heads == 0
        )

    @_counted
    def prefix_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float,
        kernel: str | None = None,
    ) -> SharedPrefixResult | None:
        """Every query (q: [N, H, D]) over the same keys and values ([L, Hkv, D], seen in full: no
        mask), on the kernel prefix_attention_kernel names (or `kernel`: "vector" runs anywhere);
        None where none runs (not bf16, a head shape without a kernel, layouts it cannot index)."""
        if (
            not self._attention_inputs_fit(q, keys, values)
            or not (_rows_of_packed_heads(keys) and _rows_of_packed_heads(values))
            or keys.stride(0) != values.stride(0)
        ):
            return None
        count, heads, dim = q.shape
        length, kv_heads = keys.shape[0], keys.shape[1]
        run = self._prefix_attention_function(
            kernel or self.prefix_attention_kernel(heads, kv_heads, dim), dim
        )
        if run is None:
            return None
        rows = count * (heads // kv_heads)
        out = torch.empty((kv_heads, rows, dim), dtype=q.dtype)
        lse = torch.empty((kv_heads, rows), dtype=torch.float32)
        status = run(
            q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), keys.stride(0), None,
            out.data_ptr(), 0, lse.data_ptr(), count, heads, kv_heads, dim, length, scale, -1,
        )  # fmt: skip
        return SharedPrefixResult(length, out, lse) if status == 0 else None

    @_counted
    def causal_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        prefix_len: int,
        scale: float,
        kernel: str | None = None,
    ) -> torch.Tensor | None:
        """One request's extend attention: its new tokens' queries (q: [N, H, D]) over the K/V at
        `slots` (int64, [prefix_len + N], already in the pool), causally: token t sees keys <
        prefix_len + t + 1, on the kernel of prefix_attention. Returns [N, H, D]; None where no
        kernel runs (as prefix_attention)."""
        if (
            not self._attention_inputs_fit(q, k_cache, v_cache)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or slots.dtype != torch.int64
            or not slots.is_contiguous()
            or len(slots) != prefix_len + q.shape[0]
        ):
            return None
        count, heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        run = self._prefix_attention_function(
            kernel or self.prefix_attention_kernel(heads, kv_heads, dim), dim
        )
        if run is None:
            return None
        out = torch.empty((count, heads, dim), dtype=q.dtype)
        status = run(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), kv_heads * dim,
            slots.data_ptr(), out.data_ptr(), heads * dim, None, count, heads, kv_heads, dim, len(slots),
            scale, prefix_len,
        )  # fmt: skip
        return out if status == 0 else None

    def _prefix_attention_function(self, kernel: str | None, dim: int) -> Callable[..., Any] | None:
        """The entry point of a prefix attention kernel (amx_attention.cpp or prefix_attention.cpp)."""
        if kernel == "amx" and self.has_amx_linear:
            return self._amx_prefix_attention
        if kernel == "vector" and dim % 16 == 0:
            return self._vector_prefix_attention
        return None

    def fused_decode(
        self,
        layers: torch.Tensor,
        hidden: torch.Tensor,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
        scale: float,
        positions: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        out_slots: torch.Tensor,
        req_to_token: torch.Tensor,
        req_rows: torch.Tensor,
        seq_lens: torch.Tensor,
        shared_prefix: torch.Tensor | None,
        quantized: bool = False,
        kv_dtype: torch.dtype | None = None,
        experts: ExpertShape | None = None,
        local_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
        flavor: FusedFlavor = FusedFlavor.LLAMA,
        window_slots: WindowSlots | None = None,
        clip: float | None = None,
    ) -> None:
        """Every decoder layer of a decode step, updating hidden ([B, hidden] bf16 or fp32,
        contiguous) in place. layers: [L, 21] int64 addresses and values (models/fused_decode.py); positions,
        out_slots, req_rows, seq_lens: per request; cos/sin tables: [positions, rotary_dim / 2] fp32
        (rotary_dim below head_dim under a partial rotary factor);
        request b's context is at req_to_token[req_rows[b], :seq_lens[b]]; shared_prefix: the KV
        slots every request's context starts with (cascade, on prefix_attention_kernel's kernel;
        bf16 only), or None. The linears are packed by pack_linear of these kernels (bf16), or,
        when quantized, described by QuantKernels.parts_layout. kv_dtype: the pool's (None: hidden's);
        a bf16 pool under fp32 hidden runs attention in bf16, as AttentionCall does. experts: the
        shape of the Mixture-of-Experts layers among them (fp32 only; None: dense MLPs only).
        local_tables: the cos/sin tables of layers marked to turn on their own (Gemma's sliding
        layers); flavor: what the layers run besides Llama's (FusedFlavor). window_slots: where the
        sliding layers' K/V lie in window slots of their own (None: at the same slots as every
        layer's). clip: q, k and v clamped to [-clip, clip] after their norms (OLMoE's; fp32 only)."""
        prefix = None if shared_prefix is None else shared_prefix.to(torch.int64).contiguous()
        rows = req_rows.to(torch.int64).contiguous()
        lens = seq_lens.to(torch.int64).contiguous()
        slots = out_slots.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        table = req_to_token
        window = WindowSlots(slots, table, rows) if window_slots is None else window_slots.contiguous()
        if any(t.dtype != torch.int64 or t.stride(1) != 1 for t in (table, window.req_to_token)):
            raise ValueError("req_to_token must be int64 with contiguous rows")
        batch, size = hidden.shape
        prefix_kernel = self.prefix_attention_kernel(heads, kv_heads, head_dim)
        kv_dtype = hidden.dtype if kv_dtype is None else kv_dtype
        run = self._function("fused_decode", hidden)
        if kv_dtype != hidden.dtype:
            mixed = (hidden.dtype, kv_dtype) == (torch.float32, torch.bfloat16)
            run = self._fused_decode_f32_kv_bf16 if mixed else None
        if quantized:
            linear_kind, usable = 2, self.quant is not None
        else:
            linear_kind = 0 if self.has_amx_linear else 1
            usable = self.linear_kernel is not None and hidden.dtype == torch.bfloat16
        if (
            run is None
            or not usable
            or (prefix is not None and (prefix_kernel is None or kv_dtype != torch.bfloat16))
            or (experts is not None and (not quantized or hidden.dtype != torch.float32))
            or (clip is not None and hidden.dtype != torch.float32)
        ):
            raise ValueError(
                "the fused decode loop needs a native linear kernel for its weights (bf16 packed, or "
                "quantized), a KV pool in the activations' dtype or bf16 under fp32, a bf16 prefix "
                "attention kernel for this head shape for a shared prefix, and fp32 activations over "
                "quantized experts for Mixture-of-Experts layers"
            )
        local_cos, local_sin = (cos_table, sin_table) if local_tables is None else local_tables
        status = run(
            linear_kind, 0 if prefix_kernel == "amx" else 1, int(flavor), layers.data_ptr(),
            layers.shape[0], hidden.data_ptr(), batch, size, intermediate, heads, kv_heads, head_dim,
            2 * cos_table.shape[1], eps, scale, 0.0 if clip is None else clip, cos_table.data_ptr(),
            sin_table.data_ptr(), local_cos.data_ptr(), local_sin.data_ptr(), positions.data_ptr(),
            slots.data_ptr(), table.data_ptr(), table.stride(0), rows.data_ptr(), lens.data_ptr(),
            0 if prefix is None else len(prefix), None if prefix is None else prefix.data_ptr(),
            window.out_slots.data_ptr(), window.req_to_token.data_ptr(), window.req_to_token.stride(0),
            window.req_rows.data_ptr(),
            *(experts.as_args() if experts is not None else (0, 0, 0, 0, 0)),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"fused decode failed with status {status}: a bug in its preconditions")


@dataclass(frozen=True)
class WindowSlots:
    """A decode step's slots as the sliding layers address them where their K/V lie in window
    slots (radixserve/cache/swa_pool.py): the new tokens', and each request's context in row
    req_rows[b] of req_to_token."""

    out_slots: torch.Tensor
    req_to_token: torch.Tensor
    req_rows: torch.Tensor

    def contiguous(self) -> WindowSlots:
        return WindowSlots(
            *(t.to(torch.int64).contiguous() for t in (self.out_slots, self.req_to_token, self.req_rows))
        )


def _rows_of_packed_heads(x: torch.Tensor) -> bool:
    """x is [rows, heads, dim] with each row's heads packed back to back (rows may be further
    apart, as in a slice of a wider projection): what the kernels index as row * stride + head * dim."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def select_cpu_kernels(choice: str, device: torch.device, isa: str = "auto") -> CpuKernels | None:
    """--cpu-kernels: 'auto' uses the native kernels on a CPU when they build; 'native' requires them
    (and raises NativeKernelsUnavailable with the reason); 'torch' never loads them.

    --cpu-isa: 'auto' builds for what RADIXSERVE_CPU_ISA names (unset: this CPU); another value
    builds for that ISA whatever the env var says ('amx': this CPU's build, which must have AMX),
    and raises NativeKernelsUnavailable where it cannot, even under 'auto': asked for by name, a
    silent fallback would measure or serve something else."""
    if choice == "torch" or device.type != "cpu":
        return None
    try:
        if isa == "auto":
            kernels = CpuKernels(load_library())
        else:
            check_isa("native" if isa == "amx" else isa, "--cpu-isa")
            kernels = CpuKernels(load_isa("native" if isa == "amx" else isa))
            if isa == "amx" and not kernels.has_amx_linear:
                raise NativeKernelsUnavailable(
                    "--cpu-isa amx: this CPU (or OS) offers no AMX tiles; "
                    f"its native build runs {kernels.isa}"
                )
    except NativeKernelsUnavailable as error:
        if choice == "native" or isa != "auto":
            raise
        logger.warning("native CPU kernels unavailable, using torch ops: %s", error)
        return None
    logger.info(
        "native CPU kernels in use (--cpu-kernels %s, --cpu-isa %s), built for %s; bf16 linear kernel: %s",
        choice,
        isa,
        kernels.isa,
        kernels.linear_kernel or "none native (oneDNN, else F.linear)",
    )
    return kernels
