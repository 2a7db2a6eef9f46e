"""Architecture-neutral model configuration parsed from HF ``config.json`` dicts.

The GGUF metadata path lives in :mod:`radixserve.models.source`; both produce the same
:class:`ModelConfig` so the model code never needs to know where weights came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ENCODER_ARCHITECTURES",
    "FUSED_PROJECTION_ARCHITECTURES",
    "MODEL_TYPE_TO_ARCH",
    "SUPPORTED_ARCHITECTURES",
    "VISION_PROJECTOR_ACTIVATIONS",
    "VISION_TOWER_ACTIVATIONS",
    "ModelConfig",
    "ModelLoadError",
    "UnsupportedModelError",
    "VisionConfig",
    "merge_eos_ids",
]


class ModelLoadError(Exception):
    """A model could not be located, parsed or loaded."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable but uses an architecture or feature we do not implement."""


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
    "BertModel",
)

# Checkpoints that store q/k/v as one qkv_proj and gate/up as one gate_up_proj (the loader splits
# them into the per-projection names every model here loads).
FUSED_PROJECTION_ARCHITECTURES: frozenset[str] = frozenset({"Phi3ForCausalLM"})

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
    "bert": "BertModel",
}

# Vision-language checkpoints: ModelConfig.architecture is their text model's architecture and
# the vision tower is described by ModelConfig.vision.
_LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
_LLAVA_MODEL_TYPE = "llava"

# Activations the native vision tower implements (radixserve/models/vision.py).
VISION_TOWER_ACTIVATIONS = frozenset({"quick_gelu", "gelu", "gelu_pytorch_tanh"})
VISION_PROJECTOR_ACTIVATIONS = frozenset({"gelu", "gelu_pytorch_tanh", "quick_gelu", "relu", "silu"})

# Keys inside a transformers-5 ``rope_parameters`` dict that are not scaling parameters.
_ROPE_NON_SCALING_KEYS = frozenset({"rope_theta", "rope_type", "type", "partial_rotary_factor"})


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


def _parse_rope(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, HF-style rope_scaling or None) from either config layout.

    transformers<5 writes top-level ``rope_theta`` + ``rope_scaling``; transformers 5 folds
    both into ``rope_parameters`` (with ``rope_type: "default"`` meaning no scaling).
    """
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        # Per-layer-type rope (e.g. {"full_attention": {...}, "sliding_attention": {...}}): we
        # only run uniform-attention models, so the full-attention entry is the relevant one.
        params = params.get("full_attention") or next(iter(params.values()))
    scaling: Mapping[str, Any] | None = None
    theta: Any = d.get("rope_theta")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        scaling = params
    legacy = d.get("rope_scaling")
    if isinstance(legacy, Mapping) and legacy:
        scaling = legacy
        theta = legacy.get("rope_theta", theta)
    if theta is None:
        theta = 10000.0

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
    return float(theta), out


def _parse_sliding_window(d: Mapping[str, Any], arch: str, num_layers: int) -> int | None:
    window = d.get("sliding_window")
    if window is None:
        return None
    if arch == "LlamaForCausalLM":
        return None  # HF Llama ignores the key even if a converted config carries it.
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        sliding_layers = num_layers
    else:
        # Qwen2/Qwen3 carry a (default) sliding_window value even when it is disabled.
        if not d.get("use_sliding_window", False):
            return None
        layer_types = d.get("layer_types")
        if isinstance(layer_types, list) and len(layer_types) == num_layers:
            sliding_layers = sum(1 for t in layer_types if t == "sliding_attention")
        else:
            sliding_layers = max(0, num_layers - int(d.get("max_window_layers") or 0))
    if sliding_layers == 0:
        return None
    if sliding_layers != num_layers:
        raise UnsupportedModelError(
            f"{arch} uses sliding-window attention on only {sliding_layers}/{num_layers} layers; "
            "radixserve only supports a uniform attention pattern across layers."
        )
    return int(window)


def _partial_rotary_factor(d: Mapping[str, Any]) -> float:
    params = d.get("rope_parameters")
    partial = d.get("partial_rotary_factor")
    if partial is None and isinstance(params, Mapping):
        partial = params.get("partial_rotary_factor")
    return 1.0 if partial is None else float(partial)


def _moe_fields(arch: str, d: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's and Qwen2-MoE's experts: a layer is sparse unless listed in mlp_only_layers,
    every decoder_sparse_step-th layer (counting from 1); Qwen2-MoE adds a shared expert."""
    if arch == "MixtralForCausalLM":
        # Every layer sparse; the chosen experts' probabilities always renormalized.
        experts = _required_int(d, "num_local_experts")
        return {
            "num_experts": experts,
            "num_experts_per_tok": _required_int(d, "num_experts_per_tok"),
            "moe_intermediate_size": _required_int(d, "intermediate_size"),
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
        "num_experts_per_tok": _required_int(d, "num_experts_per_tok") if experts else 0,
        # OLMoE's experts are intermediate_size wide (it has no dense MLP).
        "moe_intermediate_size": (
            _required_int(d, "intermediate_size" if arch == "OlmoeForCausalLM" else "moe_intermediate_size")
            if experts
            else 0
        ),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "sparse_layers": sparse,
        "shared_expert_intermediate_size": int(d.get("shared_expert_intermediate_size") or 0),
    }


def _check_decoder_variant(arch: str, d: Mapping[str, Any]) -> None:
    """Refuses, naming it, what the decoder does not implement: an MLP activation other than SiLU."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{arch} with hidden_act={act!r}: only silu is implemented")


def _required_int(d: Mapping[str, Any], key: str) -> int:
    val = d.get(key)
    if val is None:
        raise ModelLoadError(f"config.json is missing required field {key!r}")
    return int(val)


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
    sliding_window: int | None
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
    # Vision-language models (LLaVA) only: the image encoder in front of the text model.
    vision: VisionConfig | None = None

    @property
    def is_encoder(self) -> bool:
        return self.architecture in ENCODER_ARCHITECTURES

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
        hidden = _required_int(d, "hidden_size")
        heads = _required_int(d, "num_attention_heads")
        num_layers = _required_int(d, "num_hidden_layers")
        kv_heads = d.get("num_key_value_heads")
        # Mistral configs sometimes spell out "head_dim": null.
        head_dim = d.get("head_dim") or hidden // heads
        theta, scaling = _parse_rope(d)
        _check_decoder_variant(arch, d)

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
            vocab_size=_required_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(d, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            # All four HF config classes default to untied when the key is absent.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
            qk_norm_full_width=arch == "OlmoeForCausalLM",
            clip_qkv=float(d["clip_qkv"]) if arch == "OlmoeForCausalLM" and d.get("clip_qkv") else None,
            sliding_window=_parse_sliding_window(d, arch, num_layers),
            eos_token_ids=merge_eos_ids(d.get("eos_token_id"), gen_eos),
            bos_token_id=int(bos) if bos is not None else None,
            torch_dtype=str(dtype) if dtype is not None else None,
            partial_rotary_factor=_partial_rotary_factor(d),
            **_moe_fields(arch, d, num_layers),
        )

    @classmethod
    def _encoder_from_hf_dict(cls, arch: str, d: Mapping[str, Any]) -> ModelConfig:
        hidden = _required_int(d, "hidden_size")
        heads = _required_int(d, "num_attention_heads")
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
            vocab_size=_required_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(d, "intermediate_size"),
            num_hidden_layers=_required_int(d, "num_hidden_layers"),
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
