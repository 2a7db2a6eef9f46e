"""Architecture-neutral model configuration parsed from HF ``config.json`` dicts.

The GGUF metadata path lives in :mod:`radixserve.models.source`; both produce the same
:class:`ModelConfig` so the model code never needs to know where weights came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from radixserve.models.config_fields import (
    GEMMA3_DEFAULTS,
    check_decoder_variant,
    moe_fields,
    parse_rope,
    parse_sliding_window,
    partial_rotary_factor,
    required_int,
    served_positions,
)
from radixserve.models.errors import ModelLoadError, UnsupportedModelError

__all__ = [
    "ENCODER_ARCHITECTURES",
    "FUSED_PROJECTION_ARCHITECTURES",
    "MODEL_TYPE_TO_ARCH",
    "SANDWICH_NORM_ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "VISION_PROJECTOR_ACTIVATIONS",
    "VISION_TOWER_ACTIVATIONS",
    "ModelConfig",
    "ModelLoadError",
    "UnsupportedModelError",
    "VisionConfig",
    "merge_eos_ids",
]


SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Gemma3ForCausalLM",
    "BertModel",
)

# Checkpoints that store q/k/v as one qkv_proj and gate/up as one gate_up_proj (the loader splits
# them into the per-projection names every model here loads).
FUSED_PROJECTION_ARCHITECTURES: frozenset[str] = frozenset({"Phi3ForCausalLM"})

# Norms before and after both the attention and the MLP of every layer (four per layer).
SANDWICH_NORM_ARCHITECTURES: frozenset[str] = frozenset({"Gemma3ForCausalLM"})

# Bidirectional encoders: they only embed (no generation), with no KV cache to reuse.
ENCODER_ARCHITECTURES: frozenset[str] = frozenset({"BertModel"})

# Configs written from a bare ``XxxConfig`` (no model) carry no "architectures" list, so
# model_type is the fallback identifier.
MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "bert": "BertModel",
}

# Vision-language checkpoints: ModelConfig.architecture is their text model's architecture and
# the vision tower is described by ModelConfig.vision.
_LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
_LLAVA_MODEL_TYPE = "llava"

# Activations the native vision tower implements (radixserve/models/vision.py).
VISION_TOWER_ACTIVATIONS = frozenset({"quick_gelu", "gelu", "gelu_pytorch_tanh"})
VISION_PROJECTOR_ACTIVATIONS = frozenset({"gelu", "gelu_pytorch_tanh", "quick_gelu", "relu", "silu"})


def _unsupported_arch_message(found: str) -> str:
    return (
        f"Unsupported model architecture {found!r}. radixserve supports: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (HF model_type: {', '.join(MODEL_TYPE_TO_ARCH)}), "
        f"and {_LLAVA_ARCHITECTURE} (model_type: {_LLAVA_MODEL_TYPE}) over one of those text models."
    )


def merge_eos_ids(*sources: Any) -> list[int]:
    """Union of eos ids given as int / list / None, keeping first-seen order."""
    out: list[int] = []
    for src in sources:
        if src is None:
            continue
        items: Iterable[Any] = src if isinstance(src, (list, tuple)) else (src,)
        for item in items:
            if item is None:
                continue
            val = int(item)
            if val not in out:
                out.append(val)
    return out


def _resolve_architecture(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    if archs:
        raise UnsupportedModelError(_unsupported_arch_message(str(archs[0])))
    model_type = d.get("model_type")
    if model_type in MODEL_TYPE_TO_ARCH:
        return MODEL_TYPE_TO_ARCH[str(model_type)]
    raise UnsupportedModelError(_unsupported_arch_message(f"model_type={model_type!r}"))


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA-style image encoder: CLIP vision tower, then a 2-layer MLP into the text model's
    embedding space. Each image becomes ``tokens_per_image`` embeddings, which take the place of
    as many ``image_token_id`` tokens in the prompt."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    # HF hidden_states index: k >= 0 is the output after k encoder layers (0: the pre-layernormed
    # embeddings), negative counts from the end of that num_hidden_layers + 1 long list.
    feature_layer: int
    # "default" drops the CLS token, "full" keeps it.
    select_strategy: str
    projector_act: str
    projector_bias: bool
    image_token_id: int
    text_hidden_size: int

    def __post_init__(self) -> None:
        if self.select_strategy not in ("default", "full"):
            raise UnsupportedModelError(
                f"vision_feature_select_strategy={self.select_strategy!r} is not supported "
                "(only 'default' and 'full' are)"
            )
        if self.hidden_act not in VISION_TOWER_ACTIVATIONS:
            raise UnsupportedModelError(f"vision tower hidden_act={self.hidden_act!r} is not supported")
        if self.projector_act not in VISION_PROJECTOR_ACTIVATIONS:
            raise UnsupportedModelError(f"projector_hidden_act={self.projector_act!r} is not supported")
        if not -(self.num_hidden_layers + 1) <= self.feature_layer <= self.num_hidden_layers:
            raise ModelLoadError(
                f"vision_feature_layer={self.feature_layer} is out of range for a vision tower "
                f"with {self.num_hidden_layers} layers"
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ModelLoadError(
                f"vision hidden_size={self.hidden_size} is not a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + (1 if self.select_strategy == "full" else 0)


def _is_llava(d: Mapping[str, Any]) -> bool:
    archs = d.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    return _LLAVA_ARCHITECTURE in archs or d.get("model_type") == _LLAVA_MODEL_TYPE


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    # The window of the layers that attend through a sliding window (a query at position p sees keys
    # at positions p - window < position <= p), and which layers those are, by checkpoint index;
    # None and () where every layer sees its whole context.
    sliding_window: int | None
    sliding_layers: tuple[int, ...] = ()
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    # Encoder (BERT) only: segment embeddings and the MLP's activation; LayerNorm eps is
    # carried in rms_norm_eps.
    type_vocab_size: int = 0
    hidden_act: str = "silu"
    # The share of each head's dimensions the rotary embedding turns (Phi-4-mini: 0.75); the rest
    # pass through unrotated.
    partial_rotary_factor: float = 1.0
    # Mixture of Experts (models/moe.py): the experts of each sparse layer, how many a token takes,
    # their width, whether the chosen ones' probabilities are renormalized, and which layers are
    # sparse (the others keep a dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    # Qwen2-MoE: a shared expert every token takes, gated by a sigmoid (0: none).
    shared_expert_intermediate_size: int = 0
    # OLMoE: the q/k norms span each projection's whole width (not one head), and q, k, v are
    # clamped to [-clip_qkv, clip_qkv] (None: not clamped).
    qk_norm_full_width: bool = False
    clip_qkv: float | None = None
    # Gemma 3: the sliding layers' own rotary base and scaling (None: the same rotary as every
    # layer), and the attention's scale as query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float | None = None
    # Vision-language models (LLaVA) only: the image encoder in front of the text model.
    vision: VisionConfig | None = None

    @property
    def is_encoder(self) -> bool:
        return self.architecture in ENCODER_ARCHITECTURES

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer (checkpoint index), or None where it sees its whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def attention_scale(self) -> float:
        """What the attention multiplies q·k by (the reference's `scalar ** -0.5`, to the bit)."""
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        scale: float = scalar**-0.5
        return scale

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head the rotary embedding turns."""
        return int(self.head_dim * self.partial_rotary_factor)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(_unsupported_arch_message(self.architecture))
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelLoadError(
                f"partial_rotary_factor={self.partial_rotary_factor} of head_dim {self.head_dim} leaves "
                f"{self.rotary_dim} rotary dimensions (an even count up to head_dim is needed)"
            )
        if (self.sliding_window is None) != (not self.sliding_layers):
            raise ModelLoadError(
                f"sliding_window={self.sliding_window} with sliding layers {self.sliding_layers}: a window "
                "needs the layers it applies to, and those layers a window"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window={self.sliding_window} must be at least 1")
        if any(not 0 <= layer < self.num_hidden_layers for layer in self.sliding_layers):
            raise ModelLoadError(
                f"sliding layers {self.sliding_layers} outside the model's {self.num_hidden_layers}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_hf_dict(
        cls, d: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a parsed HF ``config.json`` (optionally ``generation_config.json``)."""
        if _is_llava(d):
            return cls._llava_from_hf_dict(d, generation_config)
        arch = _resolve_architecture(d)
        if arch in ENCODER_ARCHITECTURES:
            return cls._encoder_from_hf_dict(arch, d)
        gemma3 = arch == "Gemma3ForCausalLM"
        if gemma3:
            d = {**GEMMA3_DEFAULTS, **{k: v for k, v in d.items() if v is not None or k == "sliding_window"}}
        hidden = required_int(d, "hidden_size")
        heads = required_int(d, "num_attention_heads")
        num_layers = required_int(d, "num_hidden_layers")
        kv_heads = d.get("num_key_value_heads")
        # Mistral configs sometimes spell out "head_dim": null.
        head_dim = d.get("head_dim") or hidden // heads
        theta, scaling = parse_rope(d, default_theta=1_000_000.0 if gemma3 else 10000.0)
        check_decoder_variant(arch, d)
        window, sliding_layers = parse_sliding_window(d, arch, num_layers)
        gemma: dict[str, Any] = {}
        if gemma3:
            local_theta, local_scaling = parse_rope(d, "sliding_attention", "rope_local_base_freq")
            gemma = {
                "sliding_rope_theta": local_theta,
                "sliding_rope_scaling": local_scaling,
                "query_pre_attn_scalar": float(d["query_pre_attn_scalar"]),
                "hidden_act": str(d["hidden_activation"]),
            }

        # Qwen2 always has q/k/v bias; its config has no switch for it (Qwen2-MoE's is qkv_bias).
        attention_bias = (
            arch == "Qwen2ForCausalLM"
            or bool(d.get("attention_bias", False))
            or bool(d.get("qkv_bias", False))
        )

        gen_eos = generation_config.get("eos_token_id") if generation_config else None
        bos = d.get("bos_token_id")
        if bos is None and generation_config:
            bos = generation_config.get("bos_token_id")
        dtype = d.get("torch_dtype", d.get("dtype"))

        return cls(
            architecture=arch,
            vocab_size=required_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=required_int(d, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=served_positions(int(d.get("max_position_embeddings", 2048)), scaling),
            # All four HF config classes default to untied when the key is absent.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch
            in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "Gemma3ForCausalLM"),
            qk_norm_full_width=arch == "OlmoeForCausalLM",
            clip_qkv=float(d["clip_qkv"]) if arch == "OlmoeForCausalLM" and d.get("clip_qkv") else None,
            sliding_window=window,
            sliding_layers=sliding_layers,
            eos_token_ids=merge_eos_ids(d.get("eos_token_id"), gen_eos),
            bos_token_id=int(bos) if bos is not None else None,
            torch_dtype=str(dtype) if dtype is not None else None,
            partial_rotary_factor=partial_rotary_factor(d),
            **moe_fields(arch, d, num_layers),
            **gemma,
        )

    @classmethod
    def _encoder_from_hf_dict(cls, arch: str, d: Mapping[str, Any]) -> ModelConfig:
        hidden = required_int(d, "hidden_size")
        heads = required_int(d, "num_attention_heads")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(
                f"{arch} with position_embedding_type={d.get('position_embedding_type')!r} is not "
                "supported; only absolute position embeddings are"
            )
        act = str(d.get("hidden_act", "gelu"))
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
            raise UnsupportedModelError(f"{arch} with hidden_act={act!r} is not supported")
        dtype = d.get("torch_dtype", d.get("dtype"))
        return cls(
            architecture=arch,
            vocab_size=required_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=required_int(d, "intermediate_size"),
            num_hidden_layers=required_int(d, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=hidden // heads,
            rms_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            rope_theta=0.0,
            rope_scaling=None,
            max_position_embeddings=int(d.get("max_position_embeddings", 512)),
            tie_word_embeddings=False,
            attention_bias=True,
            qk_norm=False,
            sliding_window=None,
            torch_dtype=str(dtype) if dtype is not None else None,
            type_vocab_size=int(d.get("type_vocab_size", 2)),
            hidden_act=act,
        )

    @classmethod
    def _llava_from_hf_dict(
        cls, d: Mapping[str, Any], generation_config: Mapping[str, Any] | None
    ) -> ModelConfig:
        # Checked on the raw dict: LlavaConfig's own validation would reject some of these with
        # a less helpful message, and would accept other vision towers we cannot run.
        raw_vision = d.get("vision_config")
        vision_type = raw_vision.get("model_type") if isinstance(raw_vision, Mapping) else None
        if vision_type not in (None, "clip_vision_model"):
            raise UnsupportedModelError(
                f"{_LLAVA_ARCHITECTURE} with a {vision_type!r} vision tower is not supported "
                "(only clip_vision_model is)"
            )
        feature_layer = d.get("vision_feature_layer", -2)
        if not isinstance(feature_layer, int) or isinstance(feature_layer, bool):
            raise UnsupportedModelError(
                f"{_LLAVA_ARCHITECTURE} with vision_feature_layer={feature_layer!r} is not supported "
                "(only a single layer index is)"
            )
        strategy = d.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(
                f"{_LLAVA_ARCHITECTURE} with vision_feature_select_strategy={strategy!r} is not "
                "supported (only 'default' and 'full' are)"
            )

        # Published checkpoints (llava-hf/llava-1.5-7b-hf) spell out only the sub-config fields
        # that differ from transformers' defaults, so let transformers fill in the rest.
        from transformers import LlavaConfig

        try:
            # Any: its sub-configs are typed dict | PreTrainedConfig | None, but are configs here.
            hf: Any = LlavaConfig.from_dict(dict(d))
        except Exception as exc:  # strict-dataclass validation raises several error types
            raise ModelLoadError(f"Could not parse the {_LLAVA_ARCHITECTURE} config: {exc}") from exc
        vision: dict[str, Any] = hf.vision_config.to_dict()
        if vision.get("model_type") != "clip_vision_model":
            raise UnsupportedModelError(
                f"{_LLAVA_ARCHITECTURE} with a {vision.get('model_type')!r} vision tower is not "
                "supported (only clip_vision_model is)"
            )
        text: dict[str, Any] = hf.text_config.to_dict()
        # HF ties the LM head by the top-level flag, which LlavaConfig ORs with the text config's.
        text["tie_word_embeddings"] = bool(hf.tie_word_embeddings)
        if text.get("bos_token_id") is None:
            text["bos_token_id"] = d.get("bos_token_id")
        if d.get("torch_dtype", d.get("dtype")) is not None:
            text["torch_dtype"] = d.get("torch_dtype", d.get("dtype"))
        base = cls.from_hf_dict(text, generation_config)
        if base.is_encoder or base.vision is not None:
            raise UnsupportedModelError(
                f"{_LLAVA_ARCHITECTURE} over a {base.architecture} text model is not supported"
            )

        image_token = d.get("image_token_index", d.get("image_token_id", hf.image_token_index))
        base.eos_token_ids = merge_eos_ids(base.eos_token_ids, d.get("eos_token_id"))
        base.vision = VisionConfig(
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_hidden_layers=int(vision["num_hidden_layers"]),
            num_attention_heads=int(vision["num_attention_heads"]),
            image_size=int(vision["image_size"]),
            patch_size=int(vision["patch_size"]),
            num_channels=int(vision.get("num_channels", 3)),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
            hidden_act=str(vision.get("hidden_act", "quick_gelu")),
            feature_layer=feature_layer,
            select_strategy=str(strategy),
            projector_act=str(hf.projector_hidden_act),
            projector_bias=bool(hf.multimodal_projector_bias),
            image_token_id=int(image_token),
            text_hidden_size=base.hidden_size,
        )
        return base
