"""How each config.json layout spells a decoder's fields: rotary parameters (per layer type where
the types differ), which layers slide and their window, Mixture-of-Experts fields, and the variants
the decoders refuse by name. models/config.py builds a ModelConfig from them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.models.errors import ModelLoadError, UnsupportedModelError

# Keys inside a transformers-5 ``rope_parameters`` dict that are not scaling parameters.
_ROPE_NON_SCALING_KEYS = frozenset({"rope_theta", "rope_type", "type", "partial_rotary_factor"})


def parse_rope(
    d: Mapping[str, Any],
    layer_type: str = "full_attention",
    theta_key: str = "rope_theta",
    default_theta: float = 10000.0,
) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, HF-style rope_scaling or None) of one layer type from either config layout.

    transformers<5 writes top-level ``rope_theta`` + ``rope_scaling``; transformers 5 folds
    both into ``rope_parameters`` (with ``rope_type: "default"`` meaning no scaling), per layer type
    where the types differ (Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}). A
    top-level ``rope_scaling`` is the full-attention layers' (Gemma 3's sliding layers keep plain
    rope over ``rope_local_base_freq``, their theta_key).
    """
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        fallback = next(iter(params.values())) if layer_type == "full_attention" else None
        params = params.get(layer_type) or fallback
    scaling: Mapping[str, Any] | None = None
    theta: Any = d.get(theta_key)
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        scaling = params
    legacy = d.get("rope_scaling")
    if isinstance(legacy, Mapping) and legacy and layer_type == "full_attention":
        scaling = legacy
        theta = legacy.get("rope_theta", theta)
    if theta is None:
        theta = default_theta

    if scaling is None:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return float(theta), None
    out = {k: v for k, v in scaling.items() if k not in _ROPE_NON_SCALING_KEYS}
    out["rope_type"] = str(rope_type)
    if rope_type in ("yarn", "longrope"):
        # Phi-3 keeps the original context beside rope_scaling; without a `factor`, both take the
        # ratio of the contexts.
        keys = ["original_max_position_embeddings"] + (
            ["max_position_embeddings"] if out.get("factor") is None else []
        )
        for key in keys:
            if out.get(key) is None and d.get(key) is not None:
                out[key] = int(d[key])
    if rope_type == "dynamic":
        # transformers scales past the config's max_position_embeddings, whatever else it names.
        out["original_max_position_embeddings"] = int(d.get("max_position_embeddings", 2048))
    return float(theta), out


def served_positions(max_position_embeddings: int, scaling: Mapping[str, Any] | None) -> int:
    """The context a model is served to: its max_position_embeddings, times the factor of dynamic
    NTK scaling (whose config names the length it scales from, as vLLM and SGLang serve it)."""
    if scaling is not None and scaling.get("rope_type") == "dynamic":
        return int(max_position_embeddings * float(scaling["factor"]))
    return max_position_embeddings


_LAYER_TYPES = frozenset({"sliding_attention", "full_attention"})


def _gemma3_layer_types(d: Mapping[str, Any], num_layers: int) -> list[str]:
    """Gemma 3's attention per layer: its config's layer_types, else every sliding_window_pattern-th
    layer (counting from 1) global and the others sliding, as transformers derives them."""
    layer_types = d.get("layer_types")
    if layer_types is None:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ModelLoadError(f"layer_types must list one attention type per layer ({num_layers})")
    unknown = sorted({str(t) for t in layer_types} - _LAYER_TYPES)
    if unknown:
        raise UnsupportedModelError(
            f"Gemma3ForCausalLM with layer types {unknown}: only {sorted(_LAYER_TYPES)}"
        )
    return [str(t) for t in layer_types]


def _sliding_layers(d: Mapping[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """Which layers (by checkpoint index) attend through the sliding window, if the model has one."""
    if arch == "Gemma3ForCausalLM":
        return tuple(i for i, t in enumerate(_gemma3_layer_types(d, num_layers)) if t == "sliding_attention")
    if arch == "LlamaForCausalLM":
        return ()  # HF Llama ignores the key even if a converted config carries it.
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        return tuple(range(num_layers))
    # Qwen2/Qwen3 carry a (default) sliding_window value even when it is disabled.
    if not d.get("use_sliding_window", False):
        return ()
    layer_types = d.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    return tuple(range(int(d.get("max_window_layers") or 0), num_layers))


def parse_sliding_window(
    d: Mapping[str, Any], arch: str, num_layers: int
) -> tuple[int | None, tuple[int, ...]]:
    """The window of the layers that attend through a sliding window, and which layers those are
    (by checkpoint index): (None, ()) where none does."""
    window = d.get("sliding_window")
    sliding = _sliding_layers(d, arch, num_layers)
    if not sliding:
        return None, ()
    if window is None:
        if arch == "Gemma3ForCausalLM":
            raise ModelLoadError(f"{arch} has sliding_attention layers but no sliding_window")
        return None, ()
    return int(window), sliding


def partial_rotary_factor(d: Mapping[str, Any]) -> float:
    params = d.get("rope_parameters")
    partial = d.get("partial_rotary_factor")
    if partial is None and isinstance(params, Mapping):
        partial = params.get("partial_rotary_factor")
    return 1.0 if partial is None else float(partial)


def moe_fields(arch: str, d: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's and Qwen2-MoE's experts: a layer is sparse unless listed in mlp_only_layers,
    every decoder_sparse_step-th layer (counting from 1); Qwen2-MoE adds a shared expert."""
    if arch == "MixtralForCausalLM":
        # Every layer sparse; the chosen experts' probabilities always renormalized.
        experts = required_int(d, "num_local_experts")
        return {
            "num_experts": experts,
            "num_experts_per_tok": required_int(d, "num_experts_per_tok"),
            "moe_intermediate_size": required_int(d, "intermediate_size"),
            "norm_topk_prob": True,
            "sparse_layers": tuple(range(num_layers)),
        }
    if arch not in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM"):
        return {}
    # Hub configs name it num_experts; transformers 5 writes num_local_experts.
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    step = int(d.get("decoder_sparse_step") or 1)
    dense = set(d.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(num_layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    return {
        "num_experts": experts,
        "num_experts_per_tok": required_int(d, "num_experts_per_tok") if experts else 0,
        # OLMoE's experts are intermediate_size wide (it has no dense MLP).
        "moe_intermediate_size": (
            required_int(d, "intermediate_size" if arch == "OlmoeForCausalLM" else "moe_intermediate_size")
            if experts
            else 0
        ),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "sparse_layers": sparse,
        "shared_expert_intermediate_size": int(d.get("shared_expert_intermediate_size") or 0),
    }


def check_decoder_variant(arch: str, d: Mapping[str, Any]) -> None:
    """Refuses, naming it, what the decoder does not implement: an MLP activation other than SiLU
    (Gemma 3: other than tanh-approximated GELU), and Gemma 3's options beyond its published models."""
    if arch != "Gemma3ForCausalLM":
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{arch} with hidden_act={act!r}: only silu is implemented")
        return
    act = d.get("hidden_activation")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(
            f"{arch} with hidden_activation={act!r}: only gelu_pytorch_tanh is implemented"
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key) is not None:
            raise UnsupportedModelError(
                f"{arch} with {key}={d[key]!r}: logit soft-capping is not implemented"
            )
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            f"{arch} with use_bidirectional_attention: only causal attention is implemented"
        )
    if d.get("attention_bias"):
        raise UnsupportedModelError(
            f"{arch} with attention_bias: its projections' biases are not implemented"
        )


# Gemma3TextConfig's defaults for what a config.json may leave out (transformers fills them in).
GEMMA3_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}


def required_int(d: Mapping[str, Any], key: str) -> int:
    val = d.get(key)
    if val is None:
        raise ModelLoadError(f"config.json is missing required field {key!r}")
    return int(val)
