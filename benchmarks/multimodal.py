"""Requests per second with one image each, on a LLaVA-shaped model, with and without the image
cache hit, and transformers on the same weights in the same run.

    python benchmarks/multimodal.py [--work bench-work] [--requests 32] [--repeats 3]

The model is random: a CLIP ViT-B/16 tower at 224x224 (196 image tokens) and the SmolLM2-135M-shaped
text model of `radixserve bench offline`, bf16, written under WORK on first use. Each request is a
short question about one 320x240 PNG (sent as a data: URL) with 32 output tokens, all submitted at
once. "miss": every request has its own image (each is decoded, processed, encoded and its tokens
prefilled). "hit": every request has the same image, already cached by a warm-up request (only the
text after the image and the output run). transformers: LlavaForConditionalGeneration.generate,
one request at a time (it has no batching of its own across requests), on the miss workload.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import time
from pathlib import Path

import numpy as np

from radixserve.runtime.engine import Engine
from radixserve_tools.bench.model import SMOLLM2_135M_CONFIG, train_tokenizer

IMAGE = "<image>"
OUTPUT_TOKENS = 32
QUESTION = f"Here is a photo: {IMAGE} What does it show, and what colours stand out in it?"


def ensure_random_llava(work: Path) -> Path:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    path = work / "llava-vitb16-smollm2-bf16"
    if (path / "model.safetensors").is_file():
        return path
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE]})
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    )
    text = LlamaConfig(**{**SMOLLM2_135M_CONFIG, "vocab_size": len(tokenizer)})
    vision = CLIPVisionConfig(
        image_size=224,
        patch_size=16,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
        image_seq_length=196,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(
        path
    )
    return path


def png(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(240, 320, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def time_engine(engine: Engine, images: list[str]) -> float:
    params = {"temperature": 0.0, "max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True}
    started = time.perf_counter()
    engine.generate([QUESTION] * len(images), params, image_data=[[url] for url in images])
    return len(images) / (time.perf_counter() - started)


def time_transformers(model_dir: Path, images: list[bytes]) -> float:
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_id = model.config.image_token_index
    ids = [t for tok in tokenizer.encode(QUESTION) for t in ([tok] * 196 if tok == image_id else [tok])]
    started = time.perf_counter()
    with torch.inference_mode():
        for image in images:
            pixels = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
            model.generate(
                input_ids=torch.tensor([ids]),
                pixel_values=pixels["pixel_values"].to(torch.bfloat16),
                max_new_tokens=OUTPUT_TOKENS,
                min_new_tokens=OUTPUT_TOKENS,
                do_sample=False,
            )
    return len(images) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = ensure_random_llava(args.work)
    pngs = [png(i) for i in range(args.requests * (args.repeats + 1))]
    rows: dict[str, list[float]] = {"miss": [], "hit": []}
    with Engine(str(model), dtype="bfloat16", log_level="warning", max_total_tokens=40000) as engine:
        time_engine(engine, [data_url(pngs[-1])] * 2)  # warm-up (and the hit workload's image)
        for r in range(args.repeats):
            batch = pngs[r * args.requests : (r + 1) * args.requests]
            rows["miss"].append(time_engine(engine, [data_url(p) for p in batch]))
            rows["hit"].append(time_engine(engine, [data_url(pngs[-1])] * args.requests))
        encoded = engine.get_stats()["images_encoded"]
    peer = time_transformers(model, pngs[: min(8, args.requests)])
    print(f"images encoded by radixserve: {encoded}")
    title = f"{args.requests} requests, 1 image (196 tokens) + 32 output tokens"
    print(f"| {title} | req/s (median of {args.repeats}) |")
    print("|---|---|")
    print(f"| radixserve, image cache miss | {statistics.median(rows['miss']):.2f} |")
    print(f"| radixserve, image cache hit | {statistics.median(rows['hit']):.2f} |")
    print(f"| transformers (one at a time), miss | {peer:.2f} |")


if __name__ == "__main__":
    main()
