"""ModelRunner's startup choices: the attention backend and the decode path are chosen once, logged
with their reason, and reported; a named backend that cannot run fails with the reason."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixserve.config.server_args import InvalidArgumentError, ServerArgs
from radixserve.executor.model_runner import ModelRunner
from radixserve.executor.runner_config import RunnerConfig
from radixserve.kernels.native import executable_isas


def _runner(model_dir: Path, **overrides: Any) -> ModelRunner:
    fields: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 256, **overrides}
    return ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=str(model_dir), **fields)))


def test_torch_ops_only_take_the_torch_backend_and_say_why(
    tiny_model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="radixserve"):
        runner = _runner(tiny_model_dir("llama"), cpu_kernels="torch")
    described = runner.describe()
    assert described["attention_backend"] == "torch_native"
    assert "cpu_native unavailable" in described["attention_backend_reason"]
    assert described["decode_path"].startswith("torch SDPA over length buckets")
    assert described["cpu_kernels"] == "torch" and described["cpu_kernels_isa"] is None
    logged = [r.getMessage() for r in caplog.records if "attention backend:" in r.getMessage()]
    assert described["linear_kernel"] == "F.linear"  # fp32: no packing
    assert logged == [f"attention backend: torch_native ({described['attention_backend_reason']}); "
                      f"decode path: {described['decode_path']}; linear kernel: F.linear"]  # fmt: skip


def test_auto_takes_the_native_backend_where_the_kernels_load(
    tiny_model_dir: Callable[[str], Path], native_kernels: object
) -> None:
    runner = _runner(tiny_model_dir("llama"))
    described = runner.describe()
    assert described["attention_backend"] == "cpu_native"
    assert "native paged decode kernel" in described["decode_path"]
    assert described["cpu_kernels_isa"] in ("amx", "avx512_bf16", "avx512", "avx2", "x86-64")
    assert described["linear_kernel"] == "native_fp32 (up to 16 rows), F.linear"  # fp32 on the kernels
    assert runner.stats()["kernel_fallbacks"] == {}  # nothing has run yet


def test_a_named_backend_that_cannot_run_fails_at_startup(tiny_model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(
        InvalidArgumentError, match="--attention-backend cpu_native: cpu_native needs the native"
    ):
        _runner(tiny_model_dir("llama"), cpu_kernels="torch", attention_backend="cpu_native")


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"dtype": "float32"}, "depends on the row count"),
        ({"dtype": "bfloat16", "attention_backend": "torch_native"}, "cpu_native only"),
        ({"dtype": "bfloat16", "cpu_kernels": "torch"}, "cpu_native only"),
    ],
)
def test_what_cannot_be_batch_invariant_is_refused_at_startup(
    tiny_model_dir: Callable[[str], Path], native_kernels: object, overrides: dict[str, object], reason: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=reason):
        _runner(tiny_model_dir("llama"), enable_deterministic_inference=True, **overrides)


def test_batch_invariant_inference_refuses_mixture_of_experts_layers(
    tiny_model_dir: Callable[[str], Path], native_kernels: object
) -> None:
    """In bf16 their router (and dense experts) run on torch matmuls, which are not batch-invariant
    (fp32 with every expert in blocks is: tests/engine/test_deterministic.py)."""
    moe = tiny_model_dir("qwen3_moe")
    with pytest.raises(InvalidArgumentError, match="Mixture-of-Experts layers run on torch matmuls"):
        _runner(moe, dtype="bfloat16", enable_deterministic_inference=True)


def test_batch_invariant_bf16_names_its_decode_path(
    tiny_model_dir: Callable[[str], Path], native_kernels: object
) -> None:
    runner = _runner(tiny_model_dir("llama"), dtype="bfloat16", enable_deterministic_inference=True)
    path = runner.describe()["decode_path"]
    assert "batch-invariant: native paged decode kernel in 128-token pieces" in path, path


def test_runner_config_takes_exactly_its_fields_from_server_args() -> None:
    from radixserve.config.server_args import ServerArgs

    args = ServerArgs(model_path="m", attention_backend="torch_native", page_size=4, port=1234)
    config = RunnerConfig.from_server_args(args)
    assert (config.model_path, config.attention_backend, config.page_size) == ("m", "torch_native", 4)
    assert not hasattr(config, "port")


def test_cpu_isa_builds_the_kernels_for_that_isa(
    tiny_model_dir: Callable[[str], Path], native_kernels: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--cpu-isa avx2 (which wins over RADIXSERVE_CPU_ISA) runs the AVX2 kernels, bf16 linears on
    bf16_linear.cpp's AVX2 variant, in the fused decode loop."""
    if "avx2" not in executable_isas():
        pytest.skip("this CPU cannot run AVX2 code")
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "native")  # the flag wins
    runner = _runner(tiny_model_dir("llama"), dtype="bfloat16", cpu_isa="avx2")
    described = runner.describe()
    assert described["cpu_kernels_isa"] == "avx2"
    assert described["linear_kernel"] == "native_avx2"
    assert described["decode_path"].startswith("fused native decode loop")
    assert runner.stats()["kernel_fallbacks"] == {}


def test_cpu_isa_amx_without_amx_fails_at_startup(
    tiny_model_dir: Callable[[str], Path], native_kernels: Any
) -> None:
    if native_kernels.has_amx_linear:
        pytest.skip("this CPU offers AMX")
    with pytest.raises(InvalidArgumentError, match="--cpu-isa amx: this CPU \\(or OS\\) offers no AMX tiles"):
        _runner(tiny_model_dir("llama"), cpu_isa="amx")
