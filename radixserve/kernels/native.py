"""Builds csrc/*.cpp into one shared library, caches it, and loads it through ctypes.

No torch headers are needed (the build takes seconds, not minutes): the kernels take raw pointers.
They use OpenMP and are linked against the libgomp that torch ships and has already loaded, so both
share one thread pool; a second OpenMP runtime would spin its own threads against torch's on a
machine with few cores.

The library is built for this CPU (-march=native) and cached under a key of the source, the
compiler, the flags, the CPU's model and flags, and torch's OpenMP library.

RADIXSERVE_CPU_ISA builds it for less than this CPU has instead, so that the kernel paths of other
CPUs run (and are tested) here: "native" (the default) is -march=native; "avx512_bf16" is that
without AMX (a Zen 4, a Cooper Lake); "avx512" is x86-64-v4, AVX-512 F/BW/CD/DQ/VL without BF16 (a
Skylake-SP, an Ice Lake); "avx2" is x86-64-v3, no AVX-512 at all (a Haswell to Alder Lake, a Zen 1
to 3). A value this CPU cannot execute, or an unknown one, raises NativeKernelsUnavailable.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve import paths

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = sorted(SOURCE_DIR.glob("*.cpp"))
HEADERS = sorted(SOURCE_DIR.glob("*.h"))
# The target's flags come from the ISA (below). -Wno-psabi: without AVX-512 GCC notes that 64-byte
# vectors passed by value change the ABI, which no inlined helper of one library cares about.
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-std=c++20", "-shared", "-fPIC", "-Wno-psabi"]
BUILD_TIMEOUT_S = 300
ISA_ENV = "RADIXSERVE_CPU_ISA"


@dataclass(frozen=True)
class Isa:
    """A target for the native kernels: its compiler flags, the /proc/cpuinfo flags a CPU needs to
    run what they produce, and the compiled_isa() bits the build must show (None: any)."""

    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    compiled: int | None = None


# x86-64-v3 as /proc/cpuinfo names it ("abm": LZCNT), and x86-64-v4 on top of it.
_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
ISAS: dict[str, Isa] = {
    "native": Isa(("-march=native",), frozenset()),
    "avx512_bf16": Isa(("-march=native", *_NO_AMX), _V4 | {"avx512_bf16"}, 1 | 2 | 4),
    # Tuned for this CPU, as -march=native is: the tuning changes speed, never which path runs.
    "avx512": Isa(("-march=x86-64-v4", "-mtune=native"), _V4, 1 | 2),
    "avx2": Isa(("-march=x86-64-v3", "-mtune=native"), _V3, 1),
}
# The forced ISAs, narrowest first.
FORCED_ISAS = ("avx2", "avx512", "avx512_bf16")
# compiled_isa()'s bits (csrc/cpu_kernels.cpp), widest first, and the name of each level.
_COMPILED_LEVELS = ((8, "amx"), (4, "avx512_bf16"), (2, "avx512"), (1, "avx2"))

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "rms_norm": (None, [_P, _I, _P, _P, _I, _I, _F, _I]),
    "silu_and_mul": (None, [_P, _I, _P, _I, _I]),
    "gelu_tanh_and_mul": (None, [_P, _I, _P, _I, _I]),
    "rotary": (None, [_P, _I, _I, _I, _I, _I, _P, _P, _P]),
    # per part: its output and 3 leading strides, its lse and 3 strides; then out, n, a, b, dim
    "merge_by_lse": (None, [_P, _I, _I, _I] * 4 + [_P, _I, _I, _I, _I]),
    "decode_attention": (
        ctypes.c_int,
        [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _F, _I, _P, _I, _I, _P, _I],
    ),
    # linear_kind, prefix_kind, flavor, layers, num_layers, hidden, batch, hidden_size, intermediate,
    # heads, kv_heads, head_dim, rotary_dim, eps, scale, clip, cos, sin, local cos, local sin,
    # positions, out_slots, req_to_token, table_stride, req_rows, seq_lens, prefix_length,
    # prefix_slots, the sliding layers' out_slots, req_to_token, table_stride and req_rows, experts,
    # top_k, normalize, expert_intermediate, shared_intermediate
    "fused_decode": (
        ctypes.c_int,
        [_I, _I, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, _F, _F, _F, _P, _P, _P, _P, _P, _P, _P]
        + [_I, _P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I],
    ),
}
DTYPE_SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}
# Kernels with one dtype only: name -> (restype, argtypes).
PLAIN_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    # fp32 activations over a bf16 KV pool (--kv-cache-dtype bfloat16 under --dtype float32)
    "fused_decode_f32_kv_bf16": SIGNATURES["fused_decode"],
    "decode_attention_supported": (ctypes.c_int, [_I, _I]),
    "set_decode_fixed_pieces": (None, [_I]),
    "amx_linear_available": (ctypes.c_int, []),
    "compiled_isa": (ctypes.c_int, []),
    "argmax_rows_f32": (None, [_P, _I, _I, _I, _P]),
    # x, x_stride, packed weight, out, out_stride, bias, residual, residual_stride, m, n, k
    "amx_linear_bf16": (None, [_P, _I, _P, _P, _I, _P, _P, _I, _I, _I, _I]),
    # the same arguments, for the non-AMX layout (csrc/bf16_linear.cpp); and which variant it has
    "bf16_linear": (None, [_P, _I, _P, _P, _I, _P, _P, _I, _I, _I, _I]),
    "bf16_linear_isa": (ctypes.c_int, []),
    # x, x_stride, weight [n, k] as torch holds it, out, out_stride, bias, m, n, k (csrc/fp32_linear.cpp)
    "fp32_linear": (None, [_P, _I, _P, _P, _I, _P, _I, _I, _I]),
    # q, q_stride, k, v, kv_stride, slots, out, out_token, lse, n, heads, kv_heads, dim, length, scale,
    # causal_offset
    "amx_prefix_attention_bf16": (
        ctypes.c_int,
        [_P, _I, _P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I],
    ),
    # the same arguments, on vector FMAs (csrc/prefix_attention.cpp: any x86-64 CPU)
    "prefix_attention_bf16": (
        ctypes.c_int,
        [_P, _I, _P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I],
    ),
    # GGUF block-quantized weights (csrc/quant_linear.cpp): which variant the build has; the packed
    # layout's size (type, n, k) and packing (type, weight, n, row_bytes, k, out); the matmul (parts
    # layout, x, x_stride, bf16, m, k, out, out_stride, bias, residual, residual_stride); reading rows
    # back (type, weight, row_bytes, rows, count, k, out)
    "quant_linear_isa": (ctypes.c_int, []),
    "quant_packed_bytes": (_I, [ctypes.c_int, _I, _I]),
    "quant_pack": (ctypes.c_int, [ctypes.c_int, _P, _I, _I, _I, _P]),
    "quant_linear_parts": (ctypes.c_int, [_P, _P, _I, ctypes.c_int, _I, _I, _P, _I, _P, _P, _I]),
    "quant_dequantize_rows": (ctypes.c_int, [ctypes.c_int, _P, _I, _P, _I, _I, _P]),
    # A Mixture-of-Experts layer (csrc/moe.cpp): routing (logits, rows, experts, top_k, normalize,
    # chosen, weights), and its experts held in blocks (gate_up table, down table, experts, chosen,
    # weights, rows, top_k, x, x_stride, bf16, k, inter, out, out_stride), and a shared expert held in
    # blocks (gate_up layout, down layout, gate, x, x_stride, rows, k, inter, out, out_stride)
    "moe_route": (None, [_P, _I, _I, _I, ctypes.c_int, _P, _P]),
    "moe_experts": (ctypes.c_int, [_P, _P, _I, _P, _P, _I, _I, _P, _I, ctypes.c_int, _I, _I, _P, _I]),
    "moe_shared_expert": (ctypes.c_int, [_P, _P, _P, _P, _I, _I, _I, _I, _P, _I]),
}


class NativeKernelsUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    return paths.cache_dir("kernels", "RADIXSERVE_KERNEL_CACHE")


def requested_isa() -> str:
    """The ISA RADIXSERVE_CPU_ISA asks for ("native" when unset), checked against this CPU."""
    name = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    _check_isa(name)
    return name


def _check_platform() -> None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise NativeKernelsUnavailable(
            f"native kernels are built for Linux x86-64 only, not {platform.platform()}"
        )


def _check_isa(name: str, setting: str = ISA_ENV) -> None:
    """Raises NativeKernelsUnavailable unless `name` is a key of ISAS that this CPU can execute;
    the message names the setting that asked for it (the env var, or --cpu-isa)."""
    isa = ISAS.get(name)
    if isa is None:
        raise NativeKernelsUnavailable(f"{setting}={name!r} is not one of {', '.join(ISAS)} (unset: native)")
    if isa.cpu_flags:
        flags = _cpu_flags()
        if flags is None:
            raise NativeKernelsUnavailable(f"{setting}={name}: cannot read /proc/cpuinfo to check this CPU")
        missing = sorted(isa.cpu_flags - flags)
        if missing:
            raise NativeKernelsUnavailable(
                f"{setting}={name}: this CPU cannot execute it (it lacks {', '.join(missing)}); "
                f"it can run {', '.join(executable_isas()) or 'none of the forced ISAs'}, or native"
            )


def check_isa(name: str, setting: str) -> None:
    """_check_isa for a caller that names its own setting (--cpu-isa)."""
    _check_platform()
    _check_isa(name, setting)


def executable_isas() -> list[str]:
    """The forced ISAs (not native) this CPU can execute, narrowest first."""
    flags = _cpu_flags()
    return [] if flags is None else [name for name in FORCED_ISAS if ISAS[name].cpu_flags <= flags]


def compile_flags(isa: str) -> list[str]:
    """Every compiler flag of a build for `isa` (a key of ISAS)."""
    return [*FLAGS, *ISAS[isa].flags]


def library_path(isa: str | None = None) -> Path:
    """Where the library for this source, compiler, ISA (default: RADIXSERVE_CPU_ISA's), CPU and
    torch is cached; raises NativeKernelsUnavailable when it cannot be built here."""
    return _plan(requested_isa() if isa is None else isa)[2]


def _plan(isa: str) -> tuple[str, Path, Path]:
    """compiler, torch's libgomp and the cached library's path for `isa`."""
    _check_platform()
    _check_isa(isa)
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise NativeKernelsUnavailable("no C++ compiler found (install g++ or set CXX)")
    openmp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not openmp.exists():
        raise NativeKernelsUnavailable(f"this torch build ships no libgomp ({openmp} is missing)")
    version = _run([compiler, "--version"]).splitlines()[0]
    sources = [path.read_text() for path in (*SOURCES, *HEADERS)]
    parts = [*sources, version, isa, *compile_flags(isa), _cpu_signature(), str(openmp), torch.__version__]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return compiler, openmp, cache_dir() / f"cpu_kernels-{key}.so"


@functools.cache
def load_library() -> ctypes.CDLL:
    """The built library, building it first if this machine has no cached copy: for the ISA that
    RADIXSERVE_CPU_ISA names when this is first called (once per process)."""
    _check_platform()
    return load_isa(requested_isa())


@functools.cache
def load_isa(isa: str) -> ctypes.CDLL:
    """The library built for `isa` (a key of ISAS), whatever RADIXSERVE_CPU_ISA says: for tests
    that compare ISAs in one process."""
    compiler, openmp, target = _plan(isa)
    if not target.exists():
        _build(compiler, openmp, isa, target)
    library = ctypes.CDLL(str(target))
    for name, (result, arguments) in SIGNATURES.items():
        for suffix in DTYPE_SUFFIXES.values():
            function = getattr(library, f"{name}_{suffix}")
            function.restype = result
            function.argtypes = arguments
    for name, (result, arguments) in PLAIN_SIGNATURES.items():
        function = getattr(library, name)
        function.restype = result
        function.argtypes = arguments
    wanted, compiled = ISAS[isa].compiled, library.compiled_isa()
    if wanted is not None and compiled != wanted:
        raise NativeKernelsUnavailable(
            f"{ISA_ENV}={isa}: {compiler} does not target it "
            f"({' '.join(ISAS[isa].flags)} gave {_level_name(compiled)} code)"
        )
    logger.info(
        "native CPU kernels: %s (%s=%s: %s)", isa_of(library), ISA_ENV, isa, " ".join(ISAS[isa].flags)
    )
    return library


def selected_isa() -> str:
    """What the native kernels of this process (load_library()) run on: "amx" (the AMX kernels
    too: built with them and granted by the OS), "avx512_bf16", "avx512", "avx2", or "x86-64" (none
    of those). Loads (and if need be builds) the library; raises NativeKernelsUnavailable where it
    cannot."""
    return isa_of(load_library())


def isa_of(library: ctypes.CDLL) -> str:
    """What a library from load_library() or load_isa() runs on, as selected_isa() names it."""
    compiled = library.compiled_isa()
    if compiled & 8 and not library.amx_linear_available():
        compiled &= ~8  # built with AMX, which the OS does not grant this process
    return _level_name(compiled)


def _level_name(compiled: int) -> str:
    for bit, name in _COMPILED_LEVELS:
        if compiled & bit:
            return name
    return "x86-64"


def _build(compiler: str, openmp: Path, isa: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building native CPU kernels for %s with %s (once per machine)", isa, compiler)
    # Built beside the target, then renamed: processes building at once never load a partial file.
    # Each source compiles to its own object at the same time (the decode attention alone takes
    # most of the build), then one link.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        objects = [os.path.join(scratch, f"{source.stem}.o") for source in SOURCES]
        compiles = [
            [compiler, *compile_flags(isa), "-c", str(source), "-o", obj]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for done in [pool.submit(_run, command) for command in compiles]:
                done.result()
        partial = os.path.join(scratch, "library.so")
        _run([compiler, *compile_flags(isa), *objects, "-o", partial, f"-L{openmp.parent}",
              "-l:libgomp.so.1", f"-Wl,-rpath,{openmp.parent}"])  # fmt: skip
        os.replace(partial, target)


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeKernelsUnavailable(f"{command[0]} failed: {error}") from error
    if done.returncode != 0:
        raise NativeKernelsUnavailable(f"{' '.join(command[:2])} ... failed:\n{done.stderr[-2000:]}")
    return done.stdout


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    """The feature flags /proc/cpuinfo lists (those of the first CPU), or None where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))
