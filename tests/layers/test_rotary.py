"""RoPE scaling (layers/rotary.py): the cos/sin tables against transformers' own, for each kind."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Phi3Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.config import ModelConfig

HEAD_DIM, THETA, POSITIONS = 64, 10000.0, 512


def transformers_tables(
    config: Any, kind: str, seq_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as transformers' rotary embedding builds them: positions × inv_freq, times the
    attention factor."""
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), seq_len)
    freqs = torch.outer(torch.arange(POSITIONS, dtype=torch.float32), inv_freq.float())
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def ours(config: Any) -> RotaryEmbedding:
    parsed = ModelConfig.from_hf_dict(config.to_dict())
    return RotaryEmbedding(parsed.head_dim, POSITIONS, parsed.rope_theta, parsed.rope_scaling)


@pytest.mark.parametrize(
    "parameters",
    [
        {"factor": 4.0, "original_max_position_embeddings": 128},
        {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
        {"factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.5},
    ],
)
def test_yarn_tables_are_transformers(parameters: dict[str, Any]) -> None:
    config = Qwen2Config(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=POSITIONS,
        rope_parameters={"rope_type": "yarn", "rope_theta": THETA, **parameters},
    )  # fmt: skip
    rotary = ours(config)
    cos, sin = transformers_tables(config, "yarn")
    torch.testing.assert_close(rotary.cos, cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotary.sin, sin, rtol=1e-6, atol=1e-6)
    assert float(rotary.cos[0, 0]) > 1.0  # the magnitude is scaled


def test_longrope_uses_the_short_factors_within_the_original_context_and_the_long_past_it() -> None:
    original, half = 128, HEAD_DIM // 2
    config = Phi3Config(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=POSITIONS,
        original_max_position_embeddings=original,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": THETA,
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)],
        },
    )  # fmt: skip
    rotary = ours(config)
    short_cos, short_sin = transformers_tables(config, "longrope", seq_len=original)
    long_cos, long_sin = transformers_tables(config, "longrope", seq_len=POSITIONS)
    torch.testing.assert_close(rotary.cos[:original], short_cos[:original], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotary.sin[:original], short_sin[:original], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotary.cos[original:], long_cos[original:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotary.sin[original:], long_sin[original:], rtol=1e-6, atol=1e-6)


def test_dynamic_ntk_turns_each_position_as_transformers_decodes_it() -> None:
    """Within the original context the plain rotation; past it, position p on the base transformers
    computes for a sequence of p + 1 tokens (its decode step at p, seq_len a tensor as there)."""
    original = 128
    config = Qwen2Config(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=original,
        rope_parameters={"rope_type": "dynamic", "rope_theta": THETA, "factor": 4.0},
    )  # fmt: skip
    parsed = ModelConfig.from_hf_dict(config.to_dict())
    assert parsed.max_position_embeddings == 4 * original  # served to the scaled context
    rotary = RotaryEmbedding(parsed.head_dim, POSITIONS, parsed.rope_theta, parsed.rope_scaling)
    cos, sin = transformers_tables(config, "dynamic")  # at init: the original context's base
    assert torch.equal(rotary.cos[:original], cos[:original]) and torch.equal(
        rotary.sin[:original], sin[:original]
    )
    for position in (original, original + 1, 300, POSITIONS - 1):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, torch.device("cpu"), torch.tensor(position + 1))
        angles = position * inv_freq.float()
        # The bases are computed for every position at once, whose pow may round an ulp apart
        # from transformers' one at a time: within two ulps of the angle.
        tolerance = 1e-6 + 2.4e-7 * position
        torch.testing.assert_close(rotary.cos[position], angles.cos(), rtol=0, atol=tolerance)
        torch.testing.assert_close(rotary.sin[position], angles.sin(), rtol=0, atol=tolerance)
    assert not torch.allclose(rotary.cos[original:], cos[original:])


def test_an_unknown_scaling_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="rope scaling type 'ntk_by_parts' is not supported"):
        RotaryEmbedding(HEAD_DIM, POSITIONS, THETA, {"rope_type": "ntk_by_parts", "factor": 2.0})
