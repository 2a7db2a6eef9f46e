"""Gemma 3's config (both layouts, against transformers' reading of them), its weights' names
(safetensors and llama.cpp's GGUF), the refusals, and the pieces that differ from Llama's layers
(Gemma's RMSNorm, the embedding scale) against transformers' own modules."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding

from radixserve.models import loader
from radixserve.models.config import ModelConfig, ModelLoadError, UnsupportedModelError
from radixserve.models.gemma3 import Gemma3CausalLM, GemmaRMSNorm
from radixserve.models.loader import expected_weight_names
from radixserve.models.source import ModelSource, load_model_config
from tests.conftest import TINY_WINDOW
from tests.models.test_loader import _assert_matches_hf

SHAPES: dict[str, Any] = {
    "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
}  # fmt: skip


def _ours(d: dict[str, Any]) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": ["Gemma3ForCausalLM"], **d})


def _transformers(d: dict[str, Any]) -> Gemma3TextConfig:
    return Gemma3TextConfig(**d)


def _sliding(hf: Gemma3TextConfig) -> tuple[int, ...]:
    assert hf.layer_types is not None
    return tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")


def test_the_tiny_checkpoints_config(tiny_model_dir: Callable[[str], Path]) -> None:
    config = load_model_config(ModelSource("hf_dir", tiny_model_dir("gemma3")))
    assert config.architecture == "Gemma3ForCausalLM" and config.tie_word_embeddings and config.qk_norm
    assert (config.sliding_window, config.sliding_layers) == (TINY_WINDOW, (0, 2))
    assert [config.layer_window(i) for i in range(3)] == [TINY_WINDOW, None, TINY_WINDOW]
    assert (config.rope_theta, config.rope_scaling) == (10000.0, {"rope_type": "linear", "factor": 2.0})
    assert (config.sliding_rope_theta, config.sliding_rope_scaling) == (500.0, None)
    assert config.attention_scale == 24**-0.5
    assert config.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize(
    "layout",
    [
        # transformers < 5 (the published checkpoints): a pattern, two rotary bases, rope_scaling.
        {"rope_theta": 5e5, "rope_local_base_freq": 2e4, "sliding_window": 256, "sliding_window_pattern": 3,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 32},
        # transformers 5: layer_types and rope_parameters per layer type.
        {"layer_types": ["full_attention", *["sliding_attention"] * 5, "full_attention"],
         "sliding_window": 64,
         "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
        # Nothing but the shapes: transformers' defaults.
        {},
    ],
    ids=["legacy", "transformers5", "defaults"],
)  # fmt: skip
def test_both_config_layouts_read_as_transformers_reads_them(layout: dict[str, Any]) -> None:
    ours, hf = _ours({**SHAPES, **layout}), _transformers({**SHAPES, **layout})
    assert hf.rope_parameters is not None
    full, sliding = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (ours.sliding_window, ours.sliding_layers) == (hf.sliding_window, _sliding(hf))
    assert ours.rope_theta == full["rope_theta"] and ours.sliding_rope_theta == sliding["rope_theta"]
    assert (ours.rope_scaling or {}).get("factor") == full.get("factor")
    assert ours.sliding_rope_scaling is None and sliding["rope_type"] == "default"
    assert ours.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.eos_token_ids == [hf.eos_token_id] and ours.bos_token_id == hf.bos_token_id


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0: logit soft-capping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: logit soft-capping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["chunked_attention"] * 7}, "layer types \\['chunked_attention'\\]"),
    ],
)
def test_what_it_does_not_implement_is_refused_by_name(change: dict[str, Any], refusal: str) -> None:
    with pytest.raises(UnsupportedModelError, match=refusal):
        _ours({**SHAPES, **change})


def test_sliding_layers_need_a_window() -> None:
    with pytest.raises(ModelLoadError, match="no sliding_window"):
        _ours({**SHAPES, "sliding_window": None})
    everything_global = _ours({**SHAPES, "sliding_window": None, "layer_types": ["full_attention"] * 7})
    assert everything_global.sliding_window is None and everything_global.sliding_layers == ()


def test_safetensors_weights_match_transformers(tiny_model_dir: Callable[[str], Path]) -> None:
    """Four norms per layer and q/k norms under transformers' names; the tied head not repeated."""
    _assert_matches_hf(tiny_model_dir("gemma3"))


def test_llama_cpp_names_map_onto_gemmas_four_norms() -> None:
    assert (
        loader._gguf_to_hf_name("blk.3.attn_norm.weight", "gemma3") == "model.layers.3.input_layernorm.weight"
    )
    expected = {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
    }
    for theirs, ours in expected.items():
        assert loader._gguf_to_hf_name(f"blk.3.{theirs}.weight", "gemma3") == f"model.layers.3.{ours}.weight"
    # Llama's one norm before its MLP is the post-attention one.
    assert (
        loader._gguf_to_hf_name("blk.3.ffn_norm.weight", "llama")
        == "model.layers.3.post_attention_layernorm.weight"
    )
    names = set(expected_weight_names(_ours(SHAPES)))
    assert {f"model.layers.6.{n}_layernorm.weight" for n in ("pre_feedforward", "post_feedforward")} <= names
    assert "lm_head.weight" not in names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemmas_norm_and_embedding_scale_are_transformers_to_the_bit(dtype: torch.dtype) -> None:
    """Normalized and scaled by 1 + weight in fp32, rounded once; embeddings times sqrt(hidden_size)
    rounded to the model's dtype (in bf16, sqrt(64) is exact; sqrt(640), the 270M's, is not)."""
    torch.manual_seed(0)
    reference = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(64))
    ours = GemmaRMSNorm(64, 1e-6)
    ours.load("weight", reference.weight.detach().to(dtype))
    ours = ours.to(dtype)
    x = (torch.randn(5, 64) * 3).to(dtype)
    assert torch.equal(ours(x), reference.to(dtype)(x))

    for hidden in (64, 640):
        config = _ours({**SHAPES, "hidden_size": hidden, "num_attention_heads": 4, "head_dim": 16})
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = Gemma3CausalLM(config, max_positions=16)
            embedding = Gemma3TextScaledWordEmbedding(100, hidden, 0, embed_scale=hidden**0.5).to(dtype)
        finally:
            torch.set_default_dtype(previous)
        assert model.embed_tokens is not None
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embedding.weight)
        ids = torch.tensor([1, 5, 99])
        assert torch.equal(model.embed(ids), embedding(ids))
