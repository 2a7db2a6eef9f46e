"""A tiny random-weight LLaVA checkpoint (tests/conftest.py's tiny_llava_dir): CLIP tower, MLP
projector and a tiny Llama, saved by transformers with a tokenizer and a CLIP image processor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

IMAGE_TOKEN = "<image>"

# Renders plain string contents; the "<image>" placeholders are written into the text by the caller.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

TINY_VISION: dict[str, Any] = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
}


def _perturb_llava(model: torch.nn.Module) -> None:
    """conftest's _perturb_default_params, for LLaVA's parameter names: it already covers every
    bias and "*norm.weight" (tower and projector included), but not CLIP's "pre_layrnorm" nor the
    text model's final norm, which it recognises as "model.norm.weight" only."""
    from tests.conftest import _FINAL_NORM_SCALE, _perturb_default_params

    _perturb_default_params(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "model.language_model.norm.weight":
                param.copy_(_FINAL_NORM_SCALE * (1.0 + 0.1 * torch.randn_like(param)))
            elif name.endswith("pre_layrnorm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))


def sample_images() -> list[Any]:
    """Two unlike PIL images: random noise (not square, so the processor resizes and crops) and
    a flat colour."""
    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    return [Image.fromarray(noise), Image.new("RGB", (32, 32), (200, 30, 30))]


def _check_images_steer_greedy(model: Any, tokenizer: Any, processor: Any, image_token_id: int) -> None:
    # Engine tests compare greedy continuations per image: they must depend on the image.
    tokens_per_image = model.config.image_seq_length
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": IMAGE_TOKEN * tokens_per_image + "\nWhat is this?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert int((ids == image_token_id).sum()) == tokens_per_image
    pixels = processor(images=sample_images(), return_tensors="pt").pixel_values
    outs = []
    with torch.no_grad():
        for i in range(pixels.shape[0]):
            out = model.generate(
                input_ids=ids, pixel_values=pixels[i : i + 1], max_new_tokens=8, do_sample=False,
                eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            outs.append(out[0, ids.shape[1] :].tolist())
    assert outs[0] != outs[1] and all(len(set(o)) >= 3 for o in outs), f"greedy outputs degenerate: {outs}"


def build_tiny_llava(
    path: Path,
    tokenizer: Any,
    *,
    feature_layer: int = -2,
    select_strategy: str = "default",
    seed: int = 0,
) -> Path:
    """Write the checkpoint (fp32 safetensors, tokenizer with an "<image>" special token, CLIP
    image processor for 32x32 inputs) into ``path`` and return it."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    from tests.conftest import _hf_config

    path.mkdir(parents=True, exist_ok=True)
    # Round-trip through disk so the session tokenizer shared by other tests is left untouched.
    tokenizer.save_pretrained(path)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    eos_id = tok.convert_tokens_to_ids("<|endoftext|>")
    assert isinstance(image_token_id, int) and isinstance(eos_id, int)

    text_config = _hf_config("llama", len(tok), eos_id)
    grid = TINY_VISION["image_size"] // TINY_VISION["patch_size"]
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**TINY_VISION),
        text_config=text_config,
        image_token_index=image_token_id,
        image_seq_length=grid * grid + (1 if select_strategy == "full" else 0),
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=select_strategy,
        projector_hidden_act="gelu",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    _perturb_llava(model)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.bos_token_id = eos_id
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    _check_images_steer_greedy(model, tok, processor, image_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    processor.save_pretrained(path)
    return path
