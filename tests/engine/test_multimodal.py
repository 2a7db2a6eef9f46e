"""Image inputs of a vision-language model (a tiny random-weight LLaVA) against transformers on the
same weights, fp32 greedy: one and two images, cached and uncached, chunked and retracted; the
radix cache keyed by image content; limits and bad images refused with a clear error."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.runtime.engine import Engine
from tests.engine.oracle import GREEDY
from tests.vlm_fixture import IMAGE_TOKEN

MAX_NEW = 8
TOKENS_PER_IMAGE = 16  # the fixture's 32x32 images in 8x8 patches, CLS dropped


def png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


class LlavaOracle:
    """Greedy continuation with transformers' LLaVA, one prompt at a time."""

    def __init__(self, model_dir: Path):
        from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration

        self.model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_token_id = self.model.config.image_token_index

    def prompt_ids(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text)
        expanded: list[int] = []
        for t in ids:
            expanded += [t] * TOKENS_PER_IMAGE if t == self.image_token_id else [t]
        return expanded

    @torch.no_grad()
    def continue_(self, text: str, images: list[bytes], max_new_tokens: int = MAX_NEW) -> list[int]:
        from PIL import Image

        ids = self.prompt_ids(text)
        pixels = None
        if images:
            decoded = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
            pixels = self.processor(images=decoded, return_tensors="pt")["pixel_values"]
        out = self.model(input_ids=torch.tensor([ids]), pixel_values=pixels, use_cache=True)
        past, tokens = out.past_key_values, []
        for _ in range(max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
        return tokens


@pytest.fixture(scope="module")
def oracle(tiny_llava_dir: Path) -> LlavaOracle:
    return LlavaOracle(tiny_llava_dir)


@pytest.fixture
def vlm(tiny_llava_dir: Path, make_engine: Callable[..., Engine]) -> Callable[..., Engine]:
    """Engines of the tiny LLaVA with the given flags (checked idle and leak-free at the end)."""
    return lambda **flags: make_engine(tiny_llava_dir, **flags)


PARAMS = {**GREEDY, "max_new_tokens": MAX_NEW}
ONE = f"Describe {IMAGE_TOKEN} in a few words."
TWO = f"Compare {IMAGE_TOKEN} with {IMAGE_TOKEN}, please."


def generate(engine: Engine, text: str, images: list[bytes]) -> dict[str, Any]:
    result = engine.generate(text, PARAMS, image_data=[data_url(b) for b in images])
    assert isinstance(result, dict)
    return result


def test_one_and_two_images_match_transformers(vlm: Callable[..., Engine], oracle: LlavaOracle) -> None:
    engine = vlm()
    a, b = png(1), png(2)
    cases = [(ONE, [a]), (ONE, [b]), (TWO, [a, b]), (TWO, [b, a]), ("No image here.", [])]
    expected = [oracle.continue_(text, images) for text, images in cases]
    # The images matter: their continuations differ from each other.
    assert len({tuple(e) for e in expected[:4]}) >= 3
    # Uncached, one at a time; then all in one batch, where every image prefix is cached.
    for (text, images), want in zip(cases, expected, strict=True):
        result = generate(engine, text, images)
        assert result["output_ids"] == want, (text, len(images))
    texts = [text for text, _ in cases]
    batch = engine.generate(
        texts, PARAMS, image_data=[[data_url(i) for i in imgs] or None for _, imgs in cases]
    )
    assert isinstance(batch, list)
    assert [r["output_ids"] for r in batch] == expected


def test_equal_images_share_the_cache_and_different_ones_do_not(
    vlm: Callable[..., Engine], oracle: LlavaOracle
) -> None:
    engine = vlm()
    a, b = png(3), png(4)
    first = generate(engine, ONE, [a])
    prefix = len(oracle.tokenizer.encode("Describe "))
    assert first["meta_info"]["cached_tokens"] == 0
    # The same image again: everything but the last prompt token comes from the cache.
    again = generate(engine, ONE, [a])
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    assert again["output_ids"] == first["output_ids"]
    # The same text with another image shares the text before the image only.
    other = generate(engine, ONE, [b])
    assert other["meta_info"]["cached_tokens"] <= prefix
    assert other["output_ids"] == oracle.continue_(ONE, [b])
    # The same pixels in another encoding (a re-saved PNG of the same image) hit the cache.
    from PIL import Image

    resaved = io.BytesIO()
    Image.open(io.BytesIO(a)).save(resaved, format="PNG", compress_level=1)
    assert resaved.getvalue() != a
    hit = generate(engine, ONE, [resaved.getvalue()])
    assert hit["meta_info"]["cached_tokens"] == hit["meta_info"]["prompt_tokens"] - 1
    assert engine.get_stats()["images_encoded"] == 2  # a once, b once: cache hits are never encoded


@pytest.mark.parametrize(
    "flags",
    [
        {"chunked_prefill_size": 8},
        {"max_total_tokens": 160, "schedule_conservativeness": 0.05},
        {"tp_size": 2, "chunked_prefill_size": 8},
        {"enable_overlap_schedule": True},
    ],
    ids=["chunked", "retracted", "tp2", "overlap"],
)
def test_images_across_chunks_and_retraction(
    flags: dict[str, Any], vlm: Callable[..., Engine], oracle: LlavaOracle
) -> None:
    """Tensor-parallel ranks each encode the images (a replicated tower); the overlap schedule
    prepares the next batch (and encodes its images) while the last one's results are published."""
    engine = vlm(**flags)
    images = [[png(10 + i), png(20 + i)] for i in range(6)]
    max_new = 24
    params = {**GREEDY, "max_new_tokens": max_new}
    results = engine.generate([TWO] * 6, params, image_data=[[data_url(x) for x in pair] for pair in images])
    assert isinstance(results, list)
    for pair, result in zip(images, results, strict=True):
        assert result["output_ids"] == oracle.continue_(TWO, pair, max_new)
    if "max_total_tokens" in flags:
        assert engine.get_stats()["retracted_reqs"] > 0  # images encoded again after retraction


def test_chat_image_url_parts(vlm: Callable[..., Engine], oracle: LlavaOracle) -> None:
    engine = vlm()
    a = png(5)
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "What is in "},
            {"type": "image_url", "image_url": {"url": data_url(a)}},
            {"type": "text", "text": "?"},
        ]},
    ]  # fmt: skip
    from radixserve.server.openai_protocol import ChatMessage

    parsed = [ChatMessage.model_validate(m) for m in messages]
    text_messages = [m.template_dict(engine.image_token) for m in parsed]
    prompt = engine.tokenize_chat(text_messages)
    request = engine.requests.build(prompt, PARAMS, image_data=[m for p in parsed for m in p.image_urls()])
    result = engine._run_blocking([request], True)
    assert isinstance(result, dict)
    text = oracle.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is in {IMAGE_TOKEN}?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert result["output_ids"] == oracle.continue_(text, [a])


def test_bad_images_are_refused(vlm: Callable[..., Engine], tmp_path: Path) -> None:
    engine = vlm(max_images_per_request=2, max_image_pixels=64 * 64, max_image_bytes=200_000)

    def refused(text: str, images: list[Any], match: str) -> None:
        with pytest.raises(InvalidRequestError, match=match):
            engine.generate(text, PARAMS, image_data=images)

    good = data_url(png(6))
    refused(ONE, [data_url(b"not a png at all")], "could not be decoded")
    refused(ONE, [data_url(png(6)[:60])], "could not be decoded")  # truncated
    refused(ONE, ["data:image/png;base64,@@@"], "not valid base64")
    refused(ONE, [data_url(png(6, size=(100, 100)))], "--max-image-pixels")
    refused(ONE, ["A" * 300_000], "--max-image-bytes")
    refused(f"{IMAGE_TOKEN}{IMAGE_TOKEN}{IMAGE_TOKEN}", [good] * 3, "--max-images-per-request")
    refused(ONE, [good, good], "2 images")  # one image token, two images
    refused("No image token.", [good], "0 image tokens")
    refused(ONE, ["http://127.0.0.1:9/x.png"], "--enable-image-url-fetch")
    image_file = tmp_path / "a.png"
    image_file.write_bytes(png(6))
    refused(ONE, [str(image_file)], "--allowed-local-media-path")
    # The server keeps serving.
    assert generate(engine, ONE, [png(6)])["meta_info"]["completion_tokens"] == MAX_NEW


def test_local_files_under_the_allowed_directory(
    vlm: Callable[..., Engine], oracle: LlavaOracle, tmp_path: Path
) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png(7))
    (tmp_path / "outside.png").write_bytes(png(7))
    engine = vlm(allowed_local_media_path=str(allowed))
    result = engine.generate(ONE, PARAMS, image_data=str(allowed / "a.png"))
    assert isinstance(result, dict)
    assert result["output_ids"] == oracle.continue_(ONE, [png(7)])
    for path in (tmp_path / "outside.png", allowed / ".." / "outside.png"):
        with pytest.raises(InvalidRequestError, match="outside --allowed-local-media-path"):
            engine.generate(ONE, PARAMS, image_data=str(path))


def test_a_text_model_refuses_images(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    with pytest.raises(InvalidRequestError, match="takes no images"):
        engine.generate("hello", PARAMS, image_data=data_url(png(1)))
