"""Mixture-of-Experts experts kept quantized (models/moe.py, models/moe_experts.py): a safetensors
MoE checkpoint under --quantization against transformers on the same weights dequantized, for the
four MoE families in two formats; reads by name, an expert replaced by a dense tensor, expert
counts, and two tensor-parallel ranks (a down cut along whole blocks, or refused)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from radixserve.distributed.parallel import ParallelContext
from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.layers.quantized import KEPT_FORMATS, QuantizationError
from radixserve.models.loader import iter_weights, quantize_linears
from radixserve.models.moe import SparseMoE
from radixserve.models.source import ModelSource, load_model_config
from radixserve.runtime.engine import Engine
from tests.engine.oracle import GreedyOracle, random_prompts
from tests.engine.test_quantized import EXACT_KV, LINEAR_SUFFIXES, dequantized_copy

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
MAX_NEW = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@dataclass
class Dequantized:
    """Transformers on the tiny checkpoint with its linears quantized and dequantized, and that
    checkpoint's tensors under their stored names (transformers' own state dict stacks experts)."""

    oracle: GreedyOracle
    tensors: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def dequantized(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Dequantized]:
    cache: dict[tuple[str, str], Dequantized] = {}

    def get(arch: str, fmt: str) -> Dequantized:
        if (arch, fmt) not in cache:
            out = dequantized_copy(tiny_model_dir(arch), fmt, tmp_path_factory.mktemp(f"{arch}-{fmt}"))
            cache[(arch, fmt)] = Dequantized(GreedyOracle(out), load_file(out / "model.safetensors"))
        return cache[(arch, fmt)]

    return get


def _assert_reads(engine: Engine, expected: dict[str, torch.Tensor], names: list[str]) -> None:
    for name in names:
        read = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**9))
        torch.testing.assert_close(read.view(expected[name].shape), expected[name], rtol=1e-6, atol=1e-7)


def _expected_bytes(path: Path, fmt: str) -> dict[str, int]:
    """The bytes by format a server holds for the checkpoint under --quantization fmt: the linears
    whose inputs fill whole blocks (experts and shared experts among them) in fmt, the rest fp32."""
    kept = KEPT_FORMATS[fmt.upper()]
    expected = {kept.name: 0, "float32": 0}
    with safe_open(str(path / "model.safetensors"), "pt") as stored:
        for name in stored.keys():  # noqa: SIM118 (safe_open is not a mapping)
            shape = stored.get_slice(name).get_shape()
            if name.endswith(LINEAR_SUFFIXES) and shape[-1] % kept.block == 0:
                expected[kept.name] += shape[0] * shape[1] // kept.block * kept.block_bytes
            else:
                expected["float32"] += 4 * int(torch.Size(shape).numel())
    return expected


def _expert_names(path: Path, expert: int = 1) -> list[str]:
    """The checkpoint's names of one expert's linears (and a shared expert's) in the last layer."""
    with safe_open(str(path / "model.safetensors"), "pt") as stored:
        names = list(stored.keys())
    return [n for n in names if "layers.1." in n and (f".experts.{expert}." in n or ".shared_expert." in n)]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_quantized_experts_match_transformers_in_a_batch(
    arch: str,
    fmt: str,
    tiny_model_dir: Callable[[str], Path],
    make_engine: Callable[..., Engine],
    dequantized: Callable[[str, str], Dequantized],
) -> None:
    """Every expert's and shared expert's linears held in fmt (none dense: the fp32 bytes are the
    router's, norms', embeddings' and what does not fill whole blocks); greedy fp32 tokens, all
    prompts in one batch, are transformers' on the dequantized weights; reads by name give the
    dequantized values, the router its own."""
    path = tiny_model_dir(arch)
    engine = make_engine(path, quantization=fmt, dtype="auto", kv_cache_dtype=EXACT_KV)
    assert engine.get_stats()["weight_bytes"] == _expected_bytes(path, fmt)
    reference = dequantized(arch, fmt)
    prompts = random_prompts(4, seed=5)
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert isinstance(outputs, list)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out["output_ids"] == reference.oracle.continue_(prompt, MAX_NEW)
    router = next(n for n in reference.tensors if "layers.1." in n and n.endswith(".gate.weight"))
    _assert_reads(engine, reference.tensors, [*_expert_names(path), router])


def test_counts_and_an_expert_replaced_by_a_dense_tensor(
    tiny_model_dir: Callable[[str], Path],
    make_engine: Callable[..., Engine],
    dequantized: Callable[[str, str], Dequantized],
) -> None:
    """Expert counts on quantized experts: the routing transformers computes on the dequantized
    weights. Release and resume keep the experts' blocks. A dense tensor replaces a quantized
    expert's part (held dense after, the other part dequantized beside it), as it replaces a
    quantized linear's weight."""
    path = tiny_model_dir("qwen2_moe")
    engine = make_engine(path, quantization="q4_0", dtype="auto", kv_cache_dtype=EXACT_KV)
    reference = dequantized("qwen2_moe", "q4_0")
    model = reference.oracle.model
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    engine.start_expert_distribution_record()
    prompts = random_prompts(2, seed=8)
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    engine.stop_expert_distribution_record()
    counts = engine.dump_expert_distribution_record()
    assert isinstance(outputs, list)
    expected = {layer: torch.zeros(experts, dtype=torch.int64) for layer in counts}
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out["output_ids"] == reference.oracle.continue_(prompt, MAX_NEW)
        with torch.no_grad():
            routers = model(torch.tensor([prompt + out["output_ids"][:-1]]), output_router_logits=True)
        for layer, router in zip(sorted(counts), routers.router_logits, strict=True):
            chosen = router.float().softmax(-1).topk(top_k, dim=-1).indices
            expected[layer] += torch.bincount(chosen.flatten(), minlength=experts)
    assert counts == {layer: tally.tolist() for layer, tally in expected.items()}
    # Released and resumed: the experts' blocks come back as they were.
    resident = engine.get_stats()["resident_bytes"]
    assert engine.release_memory_occupation() == ["kv_cache", "weights"]
    assert engine.get_stats()["resident_bytes"] == {"weights": 0, "kv_cache": 0}
    engine.resume_memory_occupation()
    assert engine.get_stats()["resident_bytes"] == resident
    resumed = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert isinstance(resumed, list)
    assert [o["output_ids"] for o in resumed] == [o["output_ids"] for o in outputs]

    gate, up = (f"model.layers.1.mlp.experts.2.{p}_proj.weight" for p in ("gate", "up"))
    shared = "model.layers.0.mlp.shared_expert.up_proj.weight"
    originals = load_file(path / "model.safetensors")
    engine.update_weights_from_tensor([(gate, originals[gate]), (shared, originals[shared])])
    _assert_reads(engine, originals, [gate, shared])
    _assert_reads(engine, reference.tensors, [up, shared.replace("up_proj", "gate_proj")])
    # All or nothing: a later tensor of the wrong shape leaves the expert written before it as it was.
    down = "model.layers.1.mlp.experts.5.down_proj.weight"
    with pytest.raises(ValueError):
        engine.update_weights_from_tensor([(down, originals[down]), (gate, originals[gate][:, :3])])
    _assert_reads(engine, reference.tensors, [down])
    _assert_reads(engine, originals, [gate])
    # The dequantized values back (now dense): the tokens are transformers' again.
    engine.update_weights_from_tensor([(n, reference.tensors[n]) for n in (gate, shared)])
    again = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert isinstance(again, list)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outputs]


def test_two_ranks_cut_the_quantized_experts(
    tiny_model_dir: Callable[[str], Path],
    make_engine: Callable[..., Engine],
    dequantized: Callable[[str, str], Dequantized],
) -> None:
    """--tp-size 2 (Mixtral: 128 intermediate columns, 64 a rank, two whole blocks): the tokens are
    transformers' on the dequantized weights, as one rank's are; an expert reads back whole."""
    path = tiny_model_dir("mixtral")
    engine = make_engine(path, quantization="q8_0", dtype="auto", kv_cache_dtype=EXACT_KV, tp_size=2)
    # Every linear, experts' among them, cut in two: half the blocks on each rank.
    assert 2 * engine.get_stats()["weight_bytes"]["Q8_0"] == _expected_bytes(path, "q8_0")["Q8_0"]
    reference = dequantized("mixtral", "q8_0")
    prompts = random_prompts(2, seed=5)
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert isinstance(outputs, list)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out["output_ids"] == reference.oracle.continue_(prompt, MAX_NEW)
    _assert_reads(engine, reference.tensors, _expert_names(path))


def _load_layer(
    path: Path, ctx: ParallelContext, kernels: CpuKernels | None, dense: tuple[str, ...] = ()
) -> SparseMoE:
    """Layer 1's SparseMoE of the checkpoint under --quantization q8_0, as rank ctx.tp_rank loads
    it; the tensors named in `dense` come dequantized (as a format without a kernel would)."""
    source = ModelSource("hf_dir", path)
    config = load_model_config(source)
    layer = SparseMoE(config, ctx, kernels)
    prefix = "model.layers.1.mlp."
    for name, tensor in quantize_linears(iter_weights(source, config), "q8_0"):
        if name.startswith(prefix):
            short = name.removeprefix(prefix)
            layer.load(short, tensor.dequantize() if short in dense else tensor)
    return layer


def test_what_cannot_stay_quantized(
    tiny_model_dir: Callable[[str], Path], native_kernels: CpuKernels
) -> None:
    """A down of 32 columns over two ranks would cut a block of 32: refused with the reason.
    Without the quantized kernel, quantized experts load dequantized, into the stacked tensors; so
    does an expert's gate beside a dense up, whichever comes first."""
    path = tiny_model_dir("qwen3_moe")
    with pytest.raises(QuantizationError, match="whole blocks of 32 columns"):
        _load_layer(path, ParallelContext(1, 2), native_kernels)
    whole = ParallelContext()
    quantized, dense = _load_layer(path, whole, native_kernels), _load_layer(path, whole, None)
    assert not list(dense.held.linears) and dense.gate_up.shape == (8, 64, 64)
    assert quantized.gate_up.numel() == quantized.down.numel() == 0
    mixed = _load_layer(
        path, whole, native_kernels, ("experts.0.up_proj.weight", "experts.5.gate_proj.weight")
    )
    held = set(mixed.held.linears)
    assert held == {f"gate_up_{e}" for e in range(8) if e not in (0, 5)} | {f"down_{e}" for e in range(8)}
    assert mixed.gate_up.shape == (8, 64, 64) and mixed.down.numel() == 0
    for e in (0, 5):
        assert torch.equal(mixed.gate_up[e], dense.gate_up[e])
    # The kernel rounds each row of activations to int16 per block: close to fp32, not equal.
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    zero = torch.zeros_like(x)
    for layer in (quantized, mixed):
        torch.testing.assert_close(layer(x, zero), dense(x, zero), rtol=1e-2, atol=1e-3)
