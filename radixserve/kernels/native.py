"""Builds csrc/*.cpp into one shared library, caches it, and loads it through ctypes.

No torch headers are needed (the build takes seconds, not minutes): the kernels take raw pointers.
They use OpenMP and are linked against the libgomp that torch ships and has already loaded, so both
share one thread pool; a second OpenMP runtime would spin its own threads against torch's on a
machine with few cores.

The library is built for this CPU (-march=native) and cached under a key of the source, the
compiler, the flags, the CPU's model and flags, and torch's OpenMP library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = sorted(SOURCE_DIR.glob("*.cpp"))
HEADERS = sorted(SOURCE_DIR.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC"]
BUILD_TIMEOUT_S = 300

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "rms_norm": (None, [_P, _I, _P, _P, _I, _I, _F]),
    "silu_and_mul": (None, [_P, _I, _P, _I, _I]),
    "rotary": (None, [_P, _I, _I, _I, _I, _P, _P, _P]),
    # per part: its output and 3 leading strides, its lse and 3 strides; then out, n, a, b, dim
    "merge_by_lse": (None, [_P, _I, _I, _I] * 4 + [_P, _I, _I, _I, _I]),
    "decode_attention": (
        ctypes.c_int,
        [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _F, _I, _P, _I, _I, _P],
    ),
}
DTYPE_SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}
# Kernels with one dtype only: name -> (restype, argtypes).
PLAIN_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "decode_attention_supported": (ctypes.c_int, [_I, _I]),
    "amx_linear_available": (ctypes.c_int, []),
    "argmax_rows_f32": (None, [_P, _I, _I, _I, _P]),
    # x, x_stride, packed weight, out, out_stride, bias, residual, residual_stride, m, n, k
    "amx_linear_bf16": (None, [_P, _I, _P, _P, _I, _P, _P, _I, _I, _I, _I]),
    # q, q_stride, k, v, kv_stride, slots, out, out_token, lse, n, heads, kv_heads, dim, length, scale,
    # causal_offset
    "amx_prefix_attention_bf16": (
        ctypes.c_int,
        [_P, _I, _P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I],
    ),
    # layers, num_layers, hidden, batch, hidden_size, intermediate, heads, kv_heads, head_dim, eps, scale,
    # cos, sin, positions, out_slots, req_to_token, table_stride, req_rows, seq_lens, prefix_length,
    # prefix_slots
    "fused_decode_bf16": (
        ctypes.c_int,
        [_P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _F, _P, _P, _P, _P, _P, _I, _P, _P, _I, _P],
    ),
}


class NativeKernelsUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    configured = os.environ.get("RADIXSERVE_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixserve" / "kernels"


@functools.cache
def load_library() -> ctypes.CDLL:
    """The built library, building it first if this machine has no cached copy."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise NativeKernelsUnavailable(
            f"native kernels are built for Linux x86-64 only, not {platform.platform()}"
        )
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise NativeKernelsUnavailable("no C++ compiler found (install g++ or set CXX)")
    openmp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not openmp.exists():
        raise NativeKernelsUnavailable(f"this torch build ships no libgomp ({openmp} is missing)")
    version = _run([compiler, "--version"]).splitlines()[0]
    sources = [path.read_text() for path in (*SOURCES, *HEADERS)]
    parts = [*sources, version, *FLAGS, _cpu_signature(), str(openmp), torch.__version__]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    if not target.exists():
        _build(compiler, openmp, target)
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
    return library


def _build(compiler: str, openmp: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building native CPU kernels with %s (once per machine)", compiler)
    # Built beside the target, then renamed: processes building at once never load a partial file.
    handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(handle)
    command = [compiler, *FLAGS, *map(str, SOURCES), "-o", partial, f"-L{openmp.parent}", "-l:libgomp.so.1",
               f"-Wl,-rpath,{openmp.parent}"]  # fmt: skip
    try:
        _run(command)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeKernelsUnavailable(f"{command[0]} failed: {error}") from error
    if done.returncode != 0:
        raise NativeKernelsUnavailable(f"{' '.join(command[:2])} ... failed:\n{done.stderr[-2000:]}")
    return done.stdout


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))
