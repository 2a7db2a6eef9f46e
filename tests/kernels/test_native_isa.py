"""RADIXSERVE_CPU_ISA (radixserve/kernels/native.py): the kernel paths of other CPUs, built here.

scripts/test.sh runs tests/kernels once per forced ISA this CPU can execute; the tests below check
the setting itself, and (under a forced ISA) that the loaded library is the one asked for."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from radixserve.kernels import native
from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.kernels.native import ISA_ENV, NativeKernelsUnavailable
from radixserve.layers.rotary import RotaryEmbedding
from tests.kernels.select_in_subprocess import select_with


def test_each_isa_has_its_own_flags_and_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        native, "_cpu_flags", lambda: frozenset().union(*(i.cpu_flags for i in native.ISAS.values()))
    )
    paths = {}
    for isa in native.ISAS:
        monkeypatch.setenv(ISA_ENV, isa)
        assert native.requested_isa() == isa
        paths[isa] = native.library_path()
    assert len(set(paths.values())) == len(native.ISAS), paths  # each its own cache key
    monkeypatch.delenv(ISA_ENV)
    assert native.requested_isa() == "native" and native.library_path() == paths["native"]
    monkeypatch.setenv(ISA_ENV, " AVX2 ")  # spelling aside
    assert native.library_path() == paths["avx2"]

    assert "-march=native" in native.compile_flags("native")
    bf16 = native.compile_flags("avx512_bf16")
    assert "-march=native" in bf16 and {"-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"} <= set(bf16)
    assert "-march=x86-64-v4" in native.compile_flags("avx512")
    assert "-march=x86-64-v3" in native.compile_flags("avx2")
    for isa in native.ISAS:
        assert set(native.FLAGS) <= set(native.compile_flags(isa))


def test_an_unknown_isa_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ISA_ENV, "avx1024")
    with pytest.raises(
        NativeKernelsUnavailable, match=r"RADIXSERVE_CPU_ISA='avx1024' is not one of native, "
    ):
        native.library_path()


def test_an_isa_this_cpu_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Haswell-like CPU: AVX2, no AVX-512.
    monkeypatch.setattr(native, "_cpu_flags", lambda: native.ISAS["avx2"].cpu_flags | {"sse4_2"})
    assert native.executable_isas() == ["avx2"]
    monkeypatch.setenv(ISA_ENV, "avx512")
    message = r"RADIXSERVE_CPU_ISA=avx512: this CPU cannot execute it \(it lacks avx512bw, avx512cd, "
    with pytest.raises(NativeKernelsUnavailable, match=message + r".*it can run avx2, or native"):
        native.library_path()
    monkeypatch.setenv(ISA_ENV, "avx512_bf16")
    with pytest.raises(NativeKernelsUnavailable, match=r"lacks .*avx512_bf16"):
        native.library_path()
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert native.requested_isa() == "avx2"
    monkeypatch.setattr(native, "_cpu_flags", lambda: None)  # no /proc/cpuinfo
    with pytest.raises(NativeKernelsUnavailable, match="cannot read /proc/cpuinfo"):
        native.library_path()
    monkeypatch.setenv(ISA_ENV, "native")  # nothing to check
    assert native.requested_isa() == "native"


def test_select_falls_back_or_fails_on_a_bad_isa() -> None:
    """--cpu-kernels auto runs torch ops (with a warning); native fails with the reason."""
    done = select_with({ISA_ENV: "sse9"})
    assert "REASON RADIXSERVE_CPU_ISA='sse9' is not one of" in done.stdout
    assert "native CPU kernels unavailable, using torch ops" in done.stderr


def test_the_loaded_library_is_the_isa_asked_for() -> None:
    """Under each forced ISA (scripts/test.sh): the library reports that ISA and no AMX, and the AMX
    kernels decline (the callers then use oneDNN and torch)."""
    try:
        library = native.load_library()
    except NativeKernelsUnavailable as error:
        pytest.skip(f"native kernels unavailable here: {error}")
    isa = native.requested_isa()
    selected = native.selected_isa()
    assert selected in ("amx", "avx512_bf16", "avx512", "avx2", "x86-64")
    if isa == "native":
        return
    assert selected == isa
    assert library.compiled_isa() == native.ISAS[isa].compiled
    assert library.amx_linear_available() == 0
    # and the non-AMX matmul (csrc/bf16_linear.cpp) is the variant of that ISA
    assert library.bf16_linear_isa() == {"avx2": 1, "avx512": 2, "avx512_bf16": 4}[isa]
    assert CpuKernels(library).linear_kernel == f"native_{isa}"
    status = library.amx_prefix_attention_bf16(
        None, 0, None, None, 0, None, None, 0, None, 1, 1, 1, 32, 1, 1.0, -1
    )
    assert status == 1


def test_elementwise_kernels_give_the_same_bits_on_every_isa() -> None:
    """Under a forced ISA (scripts/test.sh): RMSNorm, SiLU-and-mul, rotary, the merge by lse, argmax,
    the vector prefix attention and the paged decode attention give exactly what the native build
    gives, so no CPU sees other numbers from them (FMA where the native build uses it, floor and 2^n
    exact without AVX-512)."""
    isa = native.requested_isa() if os.environ.get(ISA_ENV) else "native"
    if isa == "native":
        pytest.skip(f"compares a forced ISA ({ISA_ENV}) with the native build")
    try:
        forced, reference = CpuKernels(native.load_isa(isa)), CpuKernels(native.load_isa("native"))
    except NativeKernelsUnavailable as error:
        pytest.skip(f"native kernels unavailable here: {error}")
    torch.manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(64, 3000) * 12).to(dtype)
        x[0, :6] = torch.tensor([-100.0, 100.0, 0.0, float("inf"), float("-inf"), float("nan")])
        same = [
            (forced.silu_and_mul(x), reference.silu_and_mul(x)),
            (
                forced.rms_norm(x[:, :576], x[1, 600:1176], 1e-6),
                reference.rms_norm(x[:, :576], x[1, 600:1176], 1e-6),
            ),
        ]
        rotary = RotaryEmbedding(64, 4096, 10000.0, None)
        positions = torch.randint(0, 4096, (64,))
        heads = [x[:, : 12 * 64].clone().view(64, 12, 64) for _ in range(2)]
        for kernels, rotated in zip((forced, reference), heads, strict=True):
            assert kernels.rotary_(rotated, rotary.cos, rotary.sin, positions)
        same.append((heads[0], heads[1]))
        a, b = x[:, :1024].reshape(64, 4, 4, 64), x[:, 1024:2048].reshape(64, 4, 4, 64)
        lse_a, lse_b = torch.randn(64, 4, 4) * 5, torch.randn(64, 4, 4) * 5
        same.append((forced.merge_by_lse(a, lse_a, b, lse_b), reference.merge_by_lse(a, lse_a, b, lse_b)))
        for mine, theirs in same:
            assert mine is not None and theirs is not None
            assert torch.equal(mine.nan_to_num(1.0), theirs.nan_to_num(1.0)), float(
                (mine - theirs).abs().max()
            )
    scores = torch.randn(40, 5000)
    scores[3, 17] = float("nan")
    mine, theirs = forced.argmax_rows(scores), reference.argmax_rows(scores)
    assert mine is not None and theirs is not None and torch.equal(mine, theirs)
    # The vector prefix attention (csrc/prefix_attention.cpp): every sum in one order on any width.
    q = torch.randn(13, 9, 64, dtype=torch.bfloat16)
    keys, values = (torch.randn(300, 3, 64, dtype=torch.bfloat16) for _ in range(2))
    prefix = [kernels.prefix_attention(q, keys, values, 0.125, "vector") for kernels in (forced, reference)]
    assert prefix[0] is not None and prefix[1] is not None
    assert torch.equal(prefix[0].out, prefix[1].out) and torch.equal(prefix[0].lse, prefix[1].lse)
    # The paged decode attention (csrc/decode_attention.cpp): 16-lane code with AVX-512, 8-lane halves
    # without, the same sums. bf16 queries and keys multiply by vdpbf16ps where the build has
    # AVX512-BF16, which sums pairs in another order, so bf16 is compared only without it.
    dtypes = (
        [torch.float32] if native.load_isa("native").compiled_isa() & 4 else [torch.float32, torch.bfloat16]
    )
    for dtype, (group, dim), fixed in itertools.product(dtypes, [(3, 64), (1, 16), (8, 128)], [0, 128]):
        slots, batch, kv_heads = 2000, 5, 2
        k_cache, v_cache = (torch.randn(slots, kv_heads, dim).to(dtype) for _ in range(2))
        table = torch.stack([torch.randperm(slots)[:700] for _ in range(batch)])
        lens = torch.tensor([1, 33, 200, 640, 700])
        q = (torch.randn(batch, kv_heads * group, dim) * 3).to(dtype)
        decoded = []
        for kernels in (forced, reference):
            kernels.set_decode_fixed_pieces(fixed)
            decoded.append(
                kernels.decode_attention(q, k_cache, v_cache, table, torch.arange(batch), lens, 0.125)
            )
            kernels.set_decode_fixed_pieces(0)
        assert decoded[0] is not None and decoded[1] is not None
        assert torch.equal(decoded[0], decoded[1]), (dtype, group, dim, fixed)
