"""Serving quantized weights: a safetensors checkpoint quantized at load (--quantization) against
transformers on the same weights dequantized, and the engine features that must keep working on
quantized weights (batching, reads by name, release and resume, updates, batch invariance)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.config.server_args import InvalidArgumentError, ServerArgs
from radixserve.layers.quantized import KEPT_FORMATS
from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.runtime.engine import Engine
from radixserve.scheduler.process import build_scheduler
from tests.engine.oracle import GreedyOracle, random_prompts

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
# Against the fp32 oracle the KV cache is fp32 too: by default it is bf16 under quantized weights
# (executor/kv_sizing.py), whose rounding no oracle reproduces token for token.
EXACT_KV = "float32"
# The weights --quantization quantizes: the linears', Mixture-of-Experts experts' and shared
# experts' among them (Mixtral's experts are w1, w2, w3), never a router (`mlp.gate.weight`).
LINEAR_SUFFIXES = (
    *(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down")),
    *(f".w{i}.weight" for i in (1, 2, 3)),
)


def dequantized_copy(model_dir: Path, fmt: str, out: Path) -> Path:
    """model_dir with its linear weights quantized into `fmt` by gguf and dequantized again: the
    weights a quantized server multiplies with, for transformers to run in fp32. A weight whose
    inputs do not fill whole blocks stays as it is, as --quantization leaves it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    out.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    kept = KEPT_FORMATS[fmt.upper()]
    kind = GGMLQuantizationType(kept.type_id)
    for name, tensor in tensors.items():
        if name.endswith(LINEAR_SUFFIXES) and tensor.shape[-1] % kept.block == 0:
            blocks = quantize(tensor.float().numpy(), kind)
            values = np.asarray(dequantize(blocks, kind), dtype=np.float32).reshape(tensor.shape)
            tensors[name] = torch.from_numpy(values).to(tensor.dtype)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def q4_oracle(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> GreedyOracle:
    model = dequantized_copy(tiny_model_dir("llama"), "q4_0", tmp_path_factory.mktemp("q4-dequantized"))
    return GreedyOracle(model)


def test_quantized_at_load_matches_transformers_in_a_batch(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine], q4_oracle: GreedyOracle
) -> None:
    """Greedy fp32 output, all prompts in one batch, token for token transformers' on the
    dequantized weights (the kernel's fp32 sums differ from torch's only in order)."""
    engine = make_engine(tiny_model_dir("llama"), quantization="q4_0", dtype="auto", kv_cache_dtype=EXACT_KV)
    info = engine.get_stats()
    assert info["linear_kernel"].startswith("quant_int16_")
    assert info["weight_bytes"]["Q4_0"] > 0
    prompts = random_prompts(6, seed=3)
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert isinstance(outputs, list)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out["output_ids"] == q4_oracle.continue_(prompt, int(GREEDY["max_new_tokens"]))


def test_weights_read_released_resumed_and_updated(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine], q4_oracle: GreedyOracle
) -> None:
    engine = make_engine(tiny_model_dir("llama"), quantization="q4_0")
    prompt = random_prompts(1, seed=5)[0]
    before = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert isinstance(before, dict)
    # Read back by checkpoint name: the dequantized values.
    name = "model.layers.0.self_attn.k_proj.weight"
    expected = q4_oracle.model.state_dict()[name]
    read = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**9)).view(expected.shape)
    torch.testing.assert_close(read, expected, rtol=1e-6, atol=1e-7)
    # Released and resumed: the quantized blocks come back as they were.
    resident = engine.get_stats()["resident_bytes"]
    assert engine.release_memory_occupation() == ["kv_cache", "weights"]
    assert engine.get_stats()["resident_bytes"] == {"weights": 0, "kv_cache": 0}
    engine.resume_memory_occupation()
    assert engine.get_stats()["resident_bytes"] == resident
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert isinstance(again, dict) and again["output_ids"] == before["output_ids"]
    # A named tensor replaces a quantized linear's weight (held dense after).
    engine.update_weights_from_tensor([(name, expected)])
    read = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**9)).view(expected.shape)
    assert torch.equal(read, expected)
    after = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert isinstance(after, dict) and after["output_ids"] == before["output_ids"]


def test_the_gguf_stays_quantized_across_a_reload_and_is_batch_invariant(
    smollm2_gguf_path: Path, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(None, dtype="auto", enable_deterministic_inference=True, max_total_tokens=2048)
    info = engine.get_stats()
    assert set(info["weight_bytes"]) >= {"Q4_1", "Q8_0"} and info["decode_path"].startswith("fused")
    # The default KV cache under quantized weights: bf16, which the fused loop and extend both read.
    assert info["kv_cache_dtype"] == "bfloat16"
    prompts = random_prompts(4, seed=7, vocab=40000)
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
    together = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert isinstance(together, list)
    assert [o["output_ids"] for o in together] == [o["output_ids"] for o in alone]  # type: ignore[index]
    engine.update_weights_from_disk(str(smollm2_gguf_path))
    assert engine.get_stats()["weight_bytes"] == info["weight_bytes"]
    table = engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=8)
    assert len(table) == 8 and any(value != 0 for value in table)
    # A quantized table is replaced by a whole checkpoint only; the refusal changes nothing.
    with pytest.raises(InvalidRequestError, match="GGUF-quantized table"):
        engine.update_weights_from_tensor([("model.embed_tokens.weight", torch.zeros(49152, 576))])
    assert engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=8) == table


def test_what_cannot_be_quantized_is_refused(
    tiny_model_dir: Callable[[str], Path], smollm2_gguf_path: Path
) -> None:
    with pytest.raises(InvalidArgumentError, match="already quantized"):
        build_scheduler(
            ServerArgs(model_path=str(smollm2_gguf_path), quantization="q4_0", log_level="warning")
        )
    with pytest.raises(InvalidArgumentError, match="needs the native quantized kernel"):
        build_scheduler(
            ServerArgs(
                model_path=str(tiny_model_dir("llama")),
                quantization="q8_0",
                cpu_kernels="torch",
                log_level="warning",
            )
        )
    with pytest.raises(InvalidArgumentError, match="--quantization must be one of"):
        ServerArgs(quantization="q2_k")


def test_lora_adapters_over_a_quantized_base(
    tiny_model_dir: Callable[[str], Path],
    make_engine: Callable[..., Engine],
    lora_adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Adapters' deltas on the quantized linears' outputs: transformers + peft on the dequantized
    base, token for token, adapters and the base mixed in one batch."""
    base = dequantized_copy(tiny_model_dir("llama"), "q8_0", tmp_path_factory.mktemp("q8-dequantized"))
    names = sorted(lora_adapters)[:2]
    engine = make_engine(
        tiny_model_dir("llama"),
        quantization="q8_0",
        kv_cache_dtype=EXACT_KV,
        enable_lora=True,
        lora_paths=[f"{name}={lora_adapters[name]}" for name in names],
    )
    prompts = random_prompts(3, seed=11)
    chosen: list[str | None] = [names[0], None, names[1]]
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=chosen)
    assert isinstance(outputs, list)
    for prompt, name, out in zip(prompts, chosen, outputs, strict=True):
        oracle = GreedyOracle(base, None if name is None else lora_adapters[name])
        assert out["output_ids"] == oracle.continue_(prompt, int(GREEDY["max_new_tokens"]))


def test_ngram_speculation_over_quantized_weights(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine], q4_oracle: GreedyOracle
) -> None:
    """Greedy output with NGRAM drafts verified on the quantized weights is the output without."""
    engine = make_engine(
        tiny_model_dir("llama"),
        quantization="q4_0",
        kv_cache_dtype=EXACT_KV,
        speculative_algorithm="NGRAM",
        disable_speculative_adaptive=True,  # drafting as the index offers, whatever this machine's speed
    )
    expected = {}
    for seed in (13, 14):
        prompt = random_prompts(1, seed=seed, lengths=[20])[0]
        expected[seed] = q4_oracle.continue_(prompt, int(GREEDY["max_new_tokens"]))
        # Twice: the second pass drafts from the first's output in the shared n-gram index.
        for _ in range(2):
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
            assert isinstance(out, dict) and out["output_ids"] == expected[seed]
    assert engine.get_stats()["spec_verify_steps"] > 0


def test_standalone_speculation_over_quantized_weights(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine], q4_oracle: GreedyOracle
) -> None:
    """A STANDALONE draft model (the same checkpoint, so it is quantized too and agrees nearly
    always): greedy output verified on the quantized weights is the output without drafts."""
    path = tiny_model_dir("llama")
    engine = make_engine(
        path,
        quantization="q4_0",
        kv_cache_dtype=EXACT_KV,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(path),
        speculative_num_steps=3,
        disable_speculative_adaptive=True,
    )
    for prompt in random_prompts(2, seed=21, lengths=[20, 9]):
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        assert isinstance(out, dict)
        assert out["output_ids"] == q4_oracle.continue_(prompt, int(GREEDY["max_new_tokens"]))
    stats = engine.get_stats()
    assert stats["spec_verify_steps"] > 0 and stats["weight_bytes"]["Q4_0"] > 0


def test_two_tensor_parallel_ranks_shard_the_blocks(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine], q4_oracle: GreedyOracle
) -> None:
    """--tp-size 2: column shards cut rows of blocks, row shards (o_proj, down_proj) cut whole blocks
    of 32 inputs; the tokens are still transformers' on the dequantized weights."""
    engine = make_engine(tiny_model_dir("llama"), quantization="q4_0", tp_size=2, kv_cache_dtype=EXACT_KV)
    assert engine.get_stats()["weight_bytes"]["Q4_0"] > 0
    prompts = random_prompts(3, seed=17)
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert isinstance(outputs, list)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out["output_ids"] == q4_oracle.continue_(prompt, int(GREEDY["max_new_tokens"]))
    name = "model.layers.1.mlp.down_proj.weight"
    read = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**9))
    assert torch.equal(
        read.view(q4_oracle.model.state_dict()[name].shape), q4_oracle.model.state_dict()[name]
    )
