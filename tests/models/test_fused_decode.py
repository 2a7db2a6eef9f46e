"""The fused native decode loop (models/fused_decode.py) against the per-layer path it replaces:
same kernels in the same order, so every logit must be bit for bit the same."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

import radixserve.models.llama as llama
from radixserve.attention.base import AttentionCall
from radixserve.config.server_args import ServerArgs
from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.process import build_scheduler


def _run(
    model_path: Path, fused: bool, monkeypatch: pytest.MonkeyPatch, **args: Any
) -> tuple[list[torch.Tensor], int, bool]:
    """Every forward's logits for two waves of requests (the first sharing a 48-token prefix, so
    decode attends it as a shared prefix; the second not), how many steps ran fused, and whether
    the fused loop took the shared-prefix steps too (where a prefix attention kernel exists)."""
    calls = {"fused": 0}
    original = CpuKernels.fused_decode

    def counting(self: CpuKernels, *args: Any, **kwargs: Any) -> None:
        calls["fused"] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(CpuKernels, "fused_decode", counting)
    if not fused:
        # The model then declares no fused plan, and the runner picks the per-layer decode path.
        monkeypatch.setattr(llama.CausalLM, "fused_decode_plan", lambda self, kv_dtype: None)
    scheduler = build_scheduler(
        ServerArgs(model_path=str(model_path), max_total_tokens=2048, log_level="warning", **args)
    )
    plan = scheduler.executor.model.fused_decode  # type: ignore[attr-defined]
    if fused and plan is None:
        pytest.skip("the fused decode loop needs the native kernels with a native linear kernel here")
    logits: list[torch.Tensor] = []
    forward = scheduler.executor.forward
    monkeypatch.setattr(scheduler.executor, "forward", lambda batch: _keep(forward(batch), logits))
    rng = random.Random(7)
    top = min(40000, scheduler.config.vocab_size)
    prefix = [rng.randrange(3, top) for _ in range(48)]
    for wave, shared in enumerate((prefix, [])):
        for i in range(4):
            ids = shared + [rng.randrange(3, top) for _ in range(5 + 3 * i)]
            params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
            scheduler.add_request(GenerateRequest(f"w{wave}-{i}", ids, SamplingParams.from_dict(params)))
        while not scheduler.is_idle:
            scheduler.step()
    scheduler.check_kv_invariant()
    monkeypatch.undo()
    return logits, calls["fused"], plan is not None and plan.shared_prefix


def _assert_fused_is_the_layer_loop(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, args: dict[str, str]
) -> None:
    fused, fused_steps, with_prefix = _run(model_path, True, monkeypatch, **args)
    plain, plain_steps, _ = _run(model_path, False, monkeypatch, **args)
    # Each wave decodes 5 steps; without a prefix attention kernel the first wave's (shared prefix)
    # run per layer.
    assert fused_steps >= 8 if with_prefix else fused_steps == 5
    assert plain_steps == 0
    assert len(fused) == len(plain)
    for step, (a, b) in enumerate(zip(fused, plain, strict=True)):
        assert torch.equal(a, b), f"step {step}: max |diff| {float((a - b).abs().max())}"


def _keep(result: tuple[torch.Tensor, torch.Tensor], into: list[torch.Tensor]) -> Any:
    into.append(result[0].clone())
    return result


# The weights: bf16 packed for the bf16 matmul (dequantized), or the GGUF's blocks on the quantized
# kernel with bf16 or fp32 activations (fused_decode_bf16 / fused_decode_f32), the latter over an fp32
# or (by default) a bf16 KV cache (fused_decode_f32_kv_bf16).
@pytest.mark.parametrize(
    "args",
    [
        {"dtype": "bfloat16", "quantization": "none"},
        {"dtype": "bfloat16"},
        {"dtype": "float32"},
        {"dtype": "float32", "kv_cache_dtype": "float32"},
    ],
    ids=["bf16-dense", "bf16-quantized", "fp32-quantized-bf16-kv", "fp32-quantized-fp32-kv"],
)
def test_fused_decode_is_bit_identical_to_the_layer_loop(
    smollm2_gguf_path: Path, monkeypatch: pytest.MonkeyPatch, args: dict[str, str]
) -> None:
    _assert_fused_is_the_layer_loop(smollm2_gguf_path, monkeypatch, args)


# Qwen3's q/k norms (OLMoE's over each projection's width, then clip_qkv), and Mixture-of-Experts
# layers with their experts in blocks (fp32 only), Qwen2-MoE's shared expert too: the router,
# routing and experts on the native calls the per-layer path makes too (models/moe.py).
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])
def test_fused_decode_runs_qk_norms_and_quantized_experts_bit_identically(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, arch: str, kv_cache_dtype: str
) -> None:
    args = {"dtype": "float32", "quantization": "q8_0", "kv_cache_dtype": kv_cache_dtype}
    _assert_fused_is_the_layer_loop(tiny_model_dir(arch), monkeypatch, args)


# Sliding windows (every layer of mistral_window; Gemma 3's sliding layers, which also turn on their
# own rotary base) and Gemma 3's layers: norms scaled by 1 + weight, the attention's and the MLP's
# outputs normed before they join the residual stream, GELU-tanh. The prompts run past the window.
# And a partial rotary factor (Phi-4-mini's): each head's leading dimensions turn.
@pytest.mark.parametrize(
    ("arch", "args"),
    [
        ("gemma3", {"dtype": "float32", "quantization": "q8_0"}),
        ("gemma3", {"dtype": "float32", "quantization": "q8_0", "kv_cache_dtype": "float32"}),
        ("gemma3", {"dtype": "bfloat16"}),
        ("mistral_window", {"dtype": "float32", "quantization": "q8_0"}),
        ("phi3_partial", {"dtype": "float32", "quantization": "q8_0"}),
    ],
    ids=[
        "gemma3-fp32-q8-bf16-kv",
        "gemma3-fp32-q8-fp32-kv",
        "gemma3-bf16-dense",
        "mistral-window",
        "phi3-partial",
    ],
)
def test_fused_decode_runs_windows_gemma_layers_and_partial_rotary_bit_identically(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, arch: str, args: dict[str, str]
) -> None:
    _assert_fused_is_the_layer_loop(tiny_model_dir(arch), monkeypatch, args)


def test_expert_layers_run_per_layer_while_recording_or_dense(tiny_model_dir: Callable[[str], Path]) -> None:
    """The fused loop counts no routed experts and runs no dense expert: such steps go per layer."""
    scheduler = build_scheduler(
        ServerArgs(
            model_path=str(tiny_model_dir("qwen3_moe")),
            dtype="float32",
            quantization="q8_0",
            max_total_tokens=512,
            log_level="warning",
        )
    )
    plan = scheduler.executor.model.fused_decode  # type: ignore[attr-defined]
    if plan is None:
        pytest.skip("the fused decode loop needs the native kernels with a native linear kernel here")
    decode = cast(AttentionCall, SimpleNamespace(metadata=None))
    assert plan.takes(decode)
    moe = plan.sparse[0]
    moe.routed = torch.zeros(moe.router.shape[0], dtype=torch.int64)
    assert not plan.takes(decode)
    moe.routed = None
    expert = moe.held.get("down_0")
    assert expert is not None
    expert.unpack()
    assert not plan.takes(decode)
    scheduler.check_kv_invariant()
