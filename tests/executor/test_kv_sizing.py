"""The KV pool's dtype and size rules (executor/kv_sizing.py)."""

from __future__ import annotations

import pytest
import torch

from radixserve.config.server_args import InvalidArgumentError, ServerArgs
from radixserve.executor import kv_sizing
from radixserve.executor.kv_sizing import CPU_MIN_KV_TOKENS, kv_cache_dtype, kv_capacity
from radixserve.executor.runner_config import RunnerConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_keeps_the_models_dtype_but_bf16_under_fp32_over_quantized_weights_on_a_cpu() -> None:
    assert kv_cache_dtype("auto", torch.float32, True, CPU) == torch.bfloat16
    assert kv_cache_dtype("auto", torch.float32, False, CPU) == torch.float32
    assert kv_cache_dtype("auto", torch.bfloat16, True, CPU) == torch.bfloat16
    assert kv_cache_dtype("auto", torch.float32, True, CUDA) == torch.float32


def test_an_explicit_dtype_is_taken_as_asked() -> None:
    assert kv_cache_dtype("float32", torch.float32, True, CPU) == torch.float32
    assert kv_cache_dtype("bf16", torch.float32, False, CPU) == torch.bfloat16
    assert kv_cache_dtype("bfloat16", torch.bfloat16, False, CUDA) == torch.bfloat16
    with pytest.raises(InvalidArgumentError, match="--kv-cache-dtype must be one of"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")


def test_a_cpu_pool_holds_the_context_within_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_sizing, "free_memory_bytes", lambda device: 64 * 2**30)
    args = RunnerConfig.from_server_args(ServerArgs(page_size=16))
    assert kv_capacity(args, 1024, 4096, CPU, gathers_kv=False) == CPU_MIN_KV_TOKENS
    assert kv_capacity(args, 1024, 40_000, CPU, gathers_kv=False) == 40_000 // 16 * 16
    # Little memory: what fits of --mem-fraction-static of it, in whole pages.
    monkeypatch.setattr(kv_sizing, "free_memory_bytes", lambda device: 10_000 * 1024)
    assert kv_capacity(args, 1024, 40_000, CPU, gathers_kv=False) == int(10_000 * 0.85) // 16 * 16
    fixed = RunnerConfig.from_server_args(ServerArgs(max_total_tokens=100, page_size=16))
    assert kv_capacity(fixed, 1024, 40_000, CPU, gathers_kv=False) == 96
    monkeypatch.setattr(kv_sizing, "free_memory_bytes", lambda device: 1024)
    with pytest.raises(InvalidArgumentError, match="no memory left for the KV cache"):
        kv_capacity(args, 1024, 40_000, CPU, gathers_kv=False)
