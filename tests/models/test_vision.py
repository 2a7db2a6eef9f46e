"""LLaVA: config parsing, checkpoint key mapping, and the native vision tower + projector against
transformers' LlavaForConditionalGeneration on the same tiny checkpoint."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radixserve.models.config import (
    VISION_PROJECTOR_ACTIVATIONS,
    VISION_TOWER_ACTIVATIONS,
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    VisionConfig,
)
from radixserve.models.loader import expected_weight_names, iter_weights
from radixserve.models.source import load_model_config, resolve_model_source
from radixserve.models.vision import _ACTIVATIONS, VisionTower
from tests.vlm_fixture import IMAGE_TOKEN, sample_images

# llava-hf/llava-1.5-7b-hf's config.json (abridged): sub-configs list only non-default fields.
LLAVA15_CONFIG: dict[str, Any] = {
    "architectures": ["LlavaForConditionalGeneration"],
    "ignore_index": -100,
    "image_token_index": 32000,
    "model_type": "llava",
    "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "lmsys/vicuna-7b-v1.5",
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "torch_dtype": "float16",
        "vocab_size": 32064,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vision_config": {
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
        "vocab_size": 32000,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": 32064,
}


def _llava15(**overrides: Any) -> dict[str, Any]:
    d = copy.deepcopy(LLAVA15_CONFIG)
    d.update(overrides)
    return d


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


def test_fixture_config(tiny_llava_dir: Path, tiny_model_dir: Callable[[str], Path]) -> None:
    cfg = load_model_config(resolve_model_source(tiny_llava_dir))
    text_only = load_model_config(resolve_model_source(tiny_model_dir("llama")))
    # The text part parses exactly like the same tiny Llama on its own (its vocab has <image> too).
    assert dataclasses.replace(cfg, vision=None, vocab_size=text_only.vocab_size) == text_only
    assert cfg.architecture == "LlamaForCausalLM" and cfg.tie_word_embeddings
    assert cfg.vocab_size == text_only.vocab_size + 1
    image_token_id = json.loads((tiny_llava_dir / "config.json").read_text())["image_token_index"]
    assert cfg.vision == VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        num_channels=3,
        layer_norm_eps=1e-5,
        hidden_act="quick_gelu",
        feature_layer=-2,
        select_strategy="default",
        projector_act="gelu",
        projector_bias=True,
        image_token_id=image_token_id,
        text_hidden_size=64,
    )
    assert cfg.vision.tokens_per_image == 16
    assert dataclasses.replace(cfg.vision, select_strategy="full").tokens_per_image == 17
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tiny_llava_dir).convert_tokens_to_ids(IMAGE_TOKEN) == image_token_id


def test_partial_llava15_config_is_filled_from_transformers_defaults() -> None:
    cfg = ModelConfig.from_hf_dict(_llava15(eos_token_id=7), {"eos_token_id": [2, 9]})
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (32064, 4096, 11008)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        32,
        32,
        32,
        128,
    )
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 4096
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.eos_token_ids == [2, 9, 7] and cfg.bos_token_id == 1
    assert cfg.torch_dtype == "float16"
    v = cfg.vision
    assert v is not None
    assert (v.hidden_size, v.intermediate_size, v.num_hidden_layers, v.num_attention_heads) == (
        1024,
        4096,
        24,
        16,
    )
    assert (v.image_size, v.patch_size, v.num_channels, v.layer_norm_eps) == (336, 14, 3, 1e-5)
    assert (v.hidden_act, v.feature_layer, v.select_strategy) == ("quick_gelu", -2, "default")
    assert (v.projector_act, v.projector_bias, v.image_token_id, v.text_hidden_size) == (
        "gelu",
        True,
        32000,
        4096,
    )
    assert v.tokens_per_image == 576


def test_llava_variants() -> None:
    # model_type alone identifies LLaVA; image_token_id is the alternative spelling.
    d = _llava15(image_token_id=5, vision_feature_select_strategy="full", vision_feature_layer=-1)
    del d["architectures"], d["image_token_index"]
    d["text_config"] = {
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias
    assert cfg.vision is not None
    assert (cfg.vision.image_token_id, cfg.vision.feature_layer, cfg.vision.text_hidden_size) == (5, -1, 128)
    assert cfg.vision.tokens_per_image == 577

    mistral = _llava15(text_config={"model_type": "mistral", "sliding_window": None})
    assert ModelConfig.from_hf_dict(mistral).architecture == "MistralForCausalLM"


@pytest.mark.parametrize(
    ("top", "text", "tied"), [(False, False, False), (False, True, True), (True, False, True)]
)
def test_llava_tie_word_embeddings(top: bool, text: bool, tied: bool) -> None:
    d = _llava15(tie_word_embeddings=top)
    d["text_config"]["tie_word_embeddings"] = text
    # HF ties by the top-level flag, which LlavaConfig ORs with the text config's.
    assert ModelConfig.from_hf_dict(d).tie_word_embeddings is tied


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"vision_config": {"model_type": "siglip_vision_model"}}, "siglip_vision_model"),
        ({"vision_feature_layer": [-2, -5]}, "vision_feature_layer"),
        ({"vision_feature_select_strategy": "cls_patch"}, "cls_patch"),
        ({"vision_config": {"model_type": "clip_vision_model", "hidden_act": "relu"}}, "hidden_act='relu'"),
        ({"projector_hidden_act": "tanh"}, "projector_hidden_act='tanh'"),
        ({"text_config": {"model_type": "gpt2"}}, "GPT2LMHeadModel|gpt2"),
        ({"text_config": {"model_type": "bert"}}, "BertModel"),
    ],
)
def test_llava_refusals(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf_dict(_llava15(**overrides))


def test_llava_bad_feature_layer_and_message() -> None:
    with pytest.raises(ModelLoadError, match="out of range"):
        ModelConfig.from_hf_dict(_llava15(vision_feature_layer=-26))
    with pytest.raises(UnsupportedModelError, match="LlavaForConditionalGeneration"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_every_accepted_activation_is_implemented() -> None:
    assert set(_ACTIVATIONS) >= VISION_TOWER_ACTIVATIONS | VISION_PROJECTOR_ACTIVATIONS


# --------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------


def _hf_model(path: Path) -> Any:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _hf_names(model: Any) -> dict[str, torch.Tensor]:
    """HF's state dict under the names our loader yields."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        for prefix, ours in (
            ("model.language_model.", "model."),
            ("model.vision_tower.", "vision.tower."),
            ("model.multi_modal_projector.", "vision.projector."),
        ):
            if key.startswith(prefix):
                out[ours + key[len(prefix) :]] = tensor
    return out


@pytest.fixture(scope="module")
def hf_llava(tiny_llava_dir: Path) -> Any:
    return _hf_model(tiny_llava_dir)


@pytest.fixture(scope="module")
def llava_weights(tiny_llava_dir: Path) -> tuple[ModelConfig, list[tuple[str, torch.Tensor]]]:
    src = resolve_model_source(tiny_llava_dir)
    cfg = load_model_config(src)
    return cfg, list(iter_weights(src, cfg))


def test_saved_key_layout(tiny_llava_dir: Path) -> None:
    # What transformers 5 save_pretrained writes (it converts back to the pre-4.52 layout).
    with safe_open(str(tiny_llava_dir / "model.safetensors"), framework="pt") as f:
        prefixes = {".".join(k.split(".")[:2]) for k in f.keys()}  # noqa: SIM118
    assert prefixes == {"language_model.model", "vision_tower.embeddings", "vision_tower.encoder"} | {
        "vision_tower.pre_layrnorm",
        "vision_tower.post_layernorm",
        "multi_modal_projector.linear_1",
        "multi_modal_projector.linear_2",
    }


def test_llava_weight_names_and_values(
    llava_weights: tuple[ModelConfig, list[tuple[str, torch.Tensor]]], hf_llava: Any
) -> None:
    cfg, weights = llava_weights
    names = [name for name, _ in weights]
    assert len(names) == len(set(names))
    text = {n for n in names if not n.startswith("vision.")}
    assert text == set(expected_weight_names(cfg))
    assert "lm_head.weight" not in text  # tied
    ref = _hf_names(hf_llava)
    assert set(names) == set(ref)
    assert "vision.tower.encoder.layers.0.self_attn.q_proj.weight" in names
    assert "vision.projector.linear_1.weight" in names
    for name, tensor in weights:
        assert torch.equal(tensor, ref[name]), name


def _rewrite(src_dir: Path, dst: Path, rename: Callable[[str], str], extra: dict[str, torch.Tensor]) -> Path:
    for f in src_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    with safe_open(str(src_dir / "model.safetensors"), framework="pt") as f:
        tensors = {rename(k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file({**tensors, **extra}, str(dst / "model.safetensors"))
    return dst


def _in_memory_layout(key: str) -> str:
    # transformers 4.52+ module layout, with an older CLIPVisionModel's vision_model level.
    for old, new in (
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ):
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def test_other_llava_layouts_load_the_same(
    tiny_llava_dir: Path, tmp_path: Path, llava_weights: tuple[ModelConfig, list[tuple[str, torch.Tensor]]]
) -> None:
    _, reference = llava_weights
    # A persisted position_ids buffer (pre-4.31 checkpoints) is ignored.
    position_ids = {"model.vision_tower.vision_model.embeddings.position_ids": torch.arange(17)[None]}
    path = _rewrite(tiny_llava_dir, tmp_path, _in_memory_layout, position_ids)
    src = resolve_model_source(path)
    got = dict(iter_weights(src, load_model_config(src)))
    assert got.keys() == dict(reference).keys()
    assert all(torch.equal(got[name], tensor) for name, tensor in reference)


def test_unknown_llava_tensor_is_rejected(tiny_llava_dir: Path, tmp_path: Path) -> None:
    path = _rewrite(tiny_llava_dir, tmp_path, lambda k: k, {"image_newline": torch.zeros(64)})
    src = resolve_model_source(path)
    with pytest.raises(UnsupportedModelError, match="image_newline"):
        list(iter_weights(src, load_model_config(src)))


# --------------------------------------------------------------------------------------
# Vision tower
# --------------------------------------------------------------------------------------


def _tower(config: VisionConfig, weights: list[tuple[str, torch.Tensor]]) -> VisionTower:
    tower = VisionTower(config)
    tower.load_weights((name.removeprefix("vision."), t) for name, t in weights if name.startswith("vision."))
    return tower


@pytest.fixture(scope="module")
def pixels(tiny_llava_dir: Path) -> torch.Tensor:
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_llava_dir)
    out: torch.Tensor = processor(images=sample_images(), return_tensors="pt").pixel_values
    assert out.shape == (2, 3, 32, 32) and out.dtype == torch.float32
    return out


@pytest.mark.parametrize("strategy", ["default", "full"])
@pytest.mark.parametrize("layer", [-2, -1, 1])
def test_encode_matches_transformers(
    layer: int,
    strategy: str,
    llava_weights: tuple[ModelConfig, list[tuple[str, torch.Tensor]]],
    hf_llava: Any,
    pixels: torch.Tensor,
) -> None:
    cfg, weights = llava_weights
    assert cfg.vision is not None
    vision = dataclasses.replace(cfg.vision, feature_layer=layer, select_strategy=strategy)
    tower = _tower(vision, weights)
    ours = tower.encode(pixels)
    assert ours.shape == (2, vision.tokens_per_image, 64) and ours.dtype == torch.float32
    with torch.no_grad():
        out = hf_llava.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=layer, vision_feature_select_strategy=strategy
        )
    ref = torch.stack(list(out.pooler_output))  # one [tokens, hidden] tensor per image
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert (ours[0] - ours[1]).abs().mean() > 0.1  # different images, different embeddings


def test_encode_casts_input_and_checks_shape(
    llava_weights: tuple[ModelConfig, list[tuple[str, torch.Tensor]]], pixels: torch.Tensor
) -> None:
    cfg, weights = llava_weights
    assert cfg.vision is not None
    tower = _tower(cfg.vision, weights)
    torch.testing.assert_close(tower.encode(pixels.double()), tower.encode(pixels))
    with pytest.raises(ValueError, match="pixel_values"):
        tower.encode(pixels[:, :, :16])
    with pytest.raises(ValueError, match="pixel_values"):
        tower.encode(pixels[0])


def test_load_weights_is_strict(llava_weights: tuple[ModelConfig, list[tuple[str, torch.Tensor]]]) -> None:
    cfg, weights = llava_weights
    assert cfg.vision is not None
    vision = [(n.removeprefix("vision."), t) for n, t in weights if n.startswith("vision.")]
    # Feature layer -2 of 3 layers: the last layer and post_layernorm are present but unused.
    assert any(n.startswith("tower.encoder.layers.2.") for n, _ in vision)
    assert any(n.startswith("tower.post_layernorm.") for n, _ in vision)
    assert not any(
        n.startswith("tower.encoder.layers.2.") for n, _ in VisionTower(cfg.vision).named_parameters()
    )

    with pytest.raises(KeyError, match=r"missing vision tensors: projector\.linear_2\.bias"):
        VisionTower(cfg.vision).load_weights(t for t in vision if t[0] != "projector.linear_2.bias")
    with pytest.raises(KeyError, match=r"unknown vision tensors: tower\.encoder\.layers\.3\.mlp\.fc1\.bias"):
        VisionTower(cfg.vision).load_weights(
            [*vision, ("tower.encoder.layers.3.mlp.fc1.bias", torch.zeros(64))]
        )
    with pytest.raises(KeyError, match=r"unknown vision tensors: projector\.linear_3\.weight"):
        VisionTower(cfg.vision).load_weights([*vision, ("projector.linear_3.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="expected shape"):
        VisionTower(cfg.vision).load_weights(
            [(n, t[:1] if n == "tower.pre_layrnorm.bias" else t) for n, t in vision]
        )
