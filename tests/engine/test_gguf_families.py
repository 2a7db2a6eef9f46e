"""Phi-3, Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE from GGUF files laid out as llama.cpp's converter lays
them out (tests/gguf_fixture.py): Phi-3's fused qkv and gate/up, LongRoPE factors and partial
rotary; each sparse layer's experts stacked per projection, its router, Qwen2-MoE's shared
expert; Mixtral as arch "llama" with experts and q/k rows interleaved. Served, the greedy tokens
are transformers' on the HF checkpoint the file was written from; with quantized tensors, on the
values those tensors hold."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from radixserve.layers.quantized import QuantizedTensor
from radixserve.models.loader import iter_weights
from radixserve.models.source import ModelSource, gguf_reader, load_model_config
from radixserve.models.tokenizer import load_tokenizer
from radixserve.runtime.engine import Engine
from tests.engine.oracle import GreedyOracle, assert_greedy_matches, random_prompts
from tests.gguf_fixture import dequantized_dir, write_gguf

MAX_NEW = 12
# A batch of mixed lengths whose every position, new tokens included, stays within phi3_longrope's
# original context of 64 (past it the reference switches a whole sequence to the long factors).
LENGTHS = [3, 10, 33, 51]
# Against the fp32 oracle the KV cache is fp32 too (quantized weights default to a bf16 one).
EXACT_KV = "float32"
FAMILIES = ["phi3", "phi3_longrope", "phi3_partial", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe_unclipped"]
# transformers reads a Mixtral GGUF (arch "llama" with experts) as a dense Llama, and no olmoe
# file at all, so it cannot check the writer there.
TRANSFORMERS_READS = [arch for arch in FAMILIES if arch not in ("mixtral", "olmoe_unclipped")]
# Quantized files: Phi-3's fused tensors (Q8_0) and its down projection (Q4_0); Mixtral's stacked
# experts (Q8_0) and its attention's q, k (rows interleaved) and v (Q4_0).
PHI3_FORMATS = {"attn_qkv": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0"}
MIXTRAL_FORMATS = {
    "ffn_gate_exps": "Q8_0",
    "ffn_up_exps": "Q8_0",
    "ffn_down_exps": "Q8_0",
    "attn_q": "Q4_0",
    "attn_k": "Q4_0",
    "attn_v": "Q4_0",
}


@pytest.fixture(scope="module")
def gguf_file(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """Factory: tiny arch -> its checkpoint as an all-F32 GGUF, alone in a folder (transformers
    would read a tokenizer_config.json beside it)."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            out = tmp_path_factory.mktemp(f"gguf-{arch}") / f"{arch}.gguf"
            cache[arch] = write_gguf(tiny_model_dir(arch), out)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_output_equals_transformers_on_the_checkpoint(
    arch: str,
    gguf_file: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(gguf_file(arch), kv_cache_dtype=EXACT_KV)
    assert_greedy_matches(engine, random_prompts(4, LENGTHS, seed=31), oracle(arch), MAX_NEW)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_config_is_the_checkpoints(
    arch: str, gguf_file: Callable[[str], Path], tiny_model_dir: Callable[[str], Path]
) -> None:
    """Experts, their width, which layers are sparse (Qwen3-MoE's layer 0 is dense), the shared
    expert, LongRoPE and the rotary share, all read from the file; the norm's epsilon to the file's
    float32."""
    ours = dataclasses.asdict(load_model_config(ModelSource("gguf", gguf_file(arch))))
    theirs = dataclasses.asdict(load_model_config(ModelSource("hf_dir", tiny_model_dir(arch))))
    assert ours.pop("rms_norm_eps") == pytest.approx(theirs.pop("rms_norm_eps"), rel=1e-7)
    ours_rope, theirs_rope = ours.pop("rope_scaling"), theirs.pop("rope_scaling")
    assert ours == theirs
    if arch == "phi3_longrope":
        # The file's float32 copies of the factors, and the attention factor its converter wrote.
        assert ours_rope.pop("attention_factor") == pytest.approx(1.1547005, rel=1e-7)
        for key in ("long_factor", "short_factor"):
            assert ours_rope.pop(key) == pytest.approx(theirs_rope.pop(key), rel=1e-7)
    assert ours_rope == theirs_rope


@pytest.mark.parametrize("arch", TRANSFORMERS_READS)
def test_transformers_reads_the_written_file_as_the_checkpoint(
    arch: str, gguf_file: Callable[[str], Path], oracle: Callable[[str], GreedyOracle]
) -> None:
    """The writer checked apart from radixserve's loader: transformers' GGUF import gives back the
    checkpoint's every weight. Its config comes from the checkpoint: transformers' GGUF config
    reading has no expert widths, LongRoPE or partial rotary for these architectures."""
    path = gguf_file(arch)
    config = AutoConfig.from_pretrained(oracle(arch).model.name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )
    expected = oracle(arch).model.state_dict()
    got = model.state_dict()
    assert set(got) == set(expected)
    unread = set()
    if arch == "qwen3_moe":
        # A dense layer's MLP in a qwen3moe file has no name in transformers' (nor llama.cpp's)
        # qwen3moe: its plain ffn_* tensors stay unread there (radixserve reads them).
        unread = {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    differ = [name for name in expected if name not in unread and not torch.equal(got[name], expected[name])]
    assert differ == []


def test_the_tokenizer_comes_from_the_file(
    gguf_file: Callable[[str], Path], tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    """The vocabulary, merges, special tokens and chat template written as tokenizer.ggml.*: the
    tokenizer the server converts from the file encodes as the checkpoint's does."""
    tokenizer = load_tokenizer(ModelSource("gguf", gguf_file("qwen2_moe")))
    text = "def main(args):\n    return  <|im_start|>user\nhi é<|im_end|>"
    assert tokenizer(text).input_ids == tiny_tokenizer(text).input_ids
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == tiny_tokenizer.apply_chat_template(
        messages, tokenize=False
    )


@pytest.fixture(scope="module")
def quantized(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, GreedyOracle]]:
    """Factory: phi3 / mixtral -> (its GGUF with some tensors quantized, transformers on the
    values those tensors hold)."""
    cache: dict[str, tuple[Path, GreedyOracle]] = {}

    def get(arch: str) -> tuple[Path, GreedyOracle]:
        if arch not in cache:
            formats = {"phi3": PHI3_FORMATS, "mixtral": MIXTRAL_FORMATS}[arch]
            out = tmp_path_factory.mktemp(f"gguf-{arch}-quantized") / f"{arch}.gguf"
            path = write_gguf(tiny_model_dir(arch), out, formats)
            dense = dequantized_dir(
                tiny_model_dir(arch), tmp_path_factory.mktemp(f"{arch}-dequantized"), formats
            )
            cache[arch] = (path, GreedyOracle(dense))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["phi3", "mixtral"])
def test_quantized_tensors_stay_in_their_blocks(
    arch: str,
    quantized: Callable[[str], tuple[Path, GreedyOracle]],
    make_engine: Callable[..., Engine],
) -> None:
    """Served as the file holds them (the default): Phi-3's fused tensors and Mixtral's experts
    in their blocks, and the tokens transformers' on the dequantized values."""
    path, reference = quantized(arch)
    engine = make_engine(path, kv_cache_dtype=EXACT_KV)
    stats = engine.get_stats()
    assert stats["weight_bytes"]["Q8_0"] > 0 and stats["weight_bytes"]["Q4_0"] > 0
    assert_greedy_matches(engine, random_prompts(4, LENGTHS, seed=37), reference, MAX_NEW)


def test_quantized_experts_dequantized(
    quantized: Callable[[str], tuple[Path, GreedyOracle]], make_engine: Callable[..., Engine]
) -> None:
    """--quantization none: the same file's experts dequantized at load, the same tokens."""
    path, reference = quantized("mixtral")
    engine = make_engine(path, kv_cache_dtype=EXACT_KV, quantization="none")
    assert set(engine.get_stats()["weight_bytes"]) == {"float32"}
    assert_greedy_matches(engine, random_prompts(4, LENGTHS, seed=37), reference, MAX_NEW)


def test_kept_experts_are_views_of_the_mapped_file(
    quantized: Callable[[str], tuple[Path, GreedyOracle]],
) -> None:
    """Each expert kept in its blocks is its slice of the stacked tensor, in the file's mapping
    (no copy), and reads back as the dequantizing loader gives it."""
    path, _ = quantized("mixtral")
    source = ModelSource("gguf", path)
    config = load_model_config(source)
    kept = dict(iter_weights(source, config, keep_quantized=True))
    mapping = gguf_reader(path).data
    start, end = mapping.ctypes.data, mapping.ctypes.data + mapping.nbytes
    experts = [kept[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(config.num_experts)]
    assert all(isinstance(t, QuantizedTensor) and t.mapped and t.row_order is None for t in experts)
    pointers = [t.data.data_ptr() for t in experts]
    assert all(start <= p < end for p in pointers)
    assert [b - a for a, b in itertools.pairwise(pointers)] == [experts[0].nbytes] * (len(experts) - 1)
    dense = dict(iter_weights(source, config))
    for e, expert in enumerate(experts):
        assert torch.equal(expert.dequantize(), dense[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])
