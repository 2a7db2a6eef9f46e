"""Image inputs on the scheduler's side (scheduler/images.py) over the fake executor, whose
"vision encoder" gives image token k the vector (image mean pixel, k, 0...) and whose predictions
depend on every context id: each image's tokens must carry its own embeddings, exactly once per
computed position, and stand-in ids that key the cache by image content."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.models.config import VisionConfig
from radixserve.protocol.messages import GenerateRequest, ImageInput, image_digest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.images import stand_in_ids
from radixserve.scheduler.request import IMAGE_ID_BASE
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_executor import (
    HIDDEN_SIZE,
    FakeExecutor,
    Results,
    expected_output,
    greedy,
    make_scheduler,
    run_until_idle,
)

VOCAB = 1024
IMAGE_TOKEN = 7
VISION = VisionConfig(
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=4,
    patch_size=2,
    num_channels=3,
    layer_norm_eps=1e-5,
    hidden_act="quick_gelu",
    feature_layer=-1,
    select_strategy="default",
    projector_act="gelu",
    projector_bias=True,
    image_token_id=IMAGE_TOKEN,
    text_hidden_size=HIDDEN_SIZE,
)
PER_IMAGE = VISION.tokens_per_image
SHAPE = [3, 4, 4]


def image(value: float, offset: int) -> ImageInput:
    raw = np.full(SHAPE, value, dtype=np.float32).tobytes()
    return ImageInput(image_digest(SHAPE, raw), raw, list(SHAPE), offset)


def prompt_with_images(before: list[int], after: list[int], count: int = 1) -> list[int]:
    return before + [IMAGE_TOKEN] * PER_IMAGE * count + after


def keyed(prompt: list[int], images: list[ImageInput]) -> list[int]:
    """The prompt as the cache and the fake model see it: each image's tokens as stand-ins."""
    ids = list(prompt)
    for img in images:
        ids[img.offset : img.offset + PER_IMAGE] = stand_in_ids(img.digest, PER_IMAGE)
    return ids


def vlm_scheduler(**args: object) -> tuple[Scheduler, FakeExecutor]:
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=1024, vision=VISION)
    return make_scheduler(executor, **args), executor


def run(
    scheduler: Scheduler, rid: str, prompt: list[int], images: list[ImageInput], max_new: int = 6
) -> Results:
    results = Results()
    results.take(
        scheduler.handle(
            GenerateRequest(rid, list(prompt), SamplingParams.from_dict(greedy(max_new)), images=images)
        )
    )
    run_until_idle(scheduler, results)
    return results


def test_stand_in_ids_key_images_by_content() -> None:
    a, b = image(0.25, 0), image(0.5, 0)
    assert stand_in_ids(a.digest, PER_IMAGE) == stand_in_ids(image(0.25, 9).digest, PER_IMAGE)
    ids_a, ids_b = stand_in_ids(a.digest, PER_IMAGE), stand_in_ids(b.digest, PER_IMAGE)
    assert ids_a[0] != ids_b[0]
    assert all(IMAGE_ID_BASE <= t < 2 * IMAGE_ID_BASE for t in ids_a + ids_b)


@pytest.mark.parametrize("chunk", [None, 3], ids=["whole", "chunked"])
def test_each_image_token_gets_its_embedding_once(chunk: int | None) -> None:
    scheduler, executor = vlm_scheduler(chunked_prefill_size=chunk)
    prompt = prompt_with_images([1, 2], [3, 4, 5], count=2)
    images = [image(0.25, 2), image(0.75, 2 + PER_IMAGE)]
    results = run(scheduler, "r", prompt, images)
    assert results.tokens["r"] == expected_output(keyed(prompt, images), 6, VOCAB)
    # Every image position exactly once, with its image's vector and its place in the image.
    by_position = {pos: (token, mean, k) for token, pos, mean, k in executor.placed}
    assert len(executor.placed) == len(by_position) == 2 * PER_IMAGE
    for img, value in zip(images, (0.25, 0.75), strict=True):
        for k in range(PER_IMAGE):
            token, mean, place = by_position[img.offset + k]
            assert token >= IMAGE_ID_BASE and mean == pytest.approx(value) and place == k
    assert sum(executor.encode_calls) == 2


def test_a_cached_image_is_not_encoded_again_and_another_image_is() -> None:
    scheduler, executor = vlm_scheduler()
    prompt = prompt_with_images([1, 2], [3, 4, 5])
    first = run(scheduler, "a1", prompt, [image(0.25, 2)])
    assert executor.encode_calls == [1]
    again = run(scheduler, "a2", prompt, [image(0.25, 2)])
    assert again.tokens["a2"] == first.tokens["a1"]
    assert executor.encode_calls == [1]  # its K/V came from the cache: no encoding
    other = run(scheduler, "b", prompt, [image(0.5, 2)])
    assert executor.encode_calls == [1, 1]
    assert other.tokens["b"] == expected_output(keyed(prompt, [image(0.5, 2)]), 6, VOCAB)
    assert other.tokens["b"] != first.tokens["a1"]


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("offset", "must hold the image token"),
        ("digest", "digest does not match"),
        ("stray", "image tokens that no image fills"),
        ("shape", "must have shape"),
        ("overlap", "overlap or fall outside"),
    ],
)
def test_inconsistent_images_are_refused(case: str, match: str) -> None:
    scheduler, _ = vlm_scheduler()
    prompt = prompt_with_images([1, 2], [3], count=2)
    images = [image(0.25, 2), image(0.5, 2 + PER_IMAGE)]
    if case == "offset":
        images[0].offset = 1
    elif case == "digest":
        images[0].digest = image(0.3, 2).digest
    elif case == "stray":
        images = images[:1]
    elif case == "shape":
        images[0].shape = [3, 2, 8]
    else:
        images[1].offset = 3
    results = run(scheduler, "r", prompt, images)
    finish = results.finish["r"]
    assert finish.type == "abort" and match in (finish.message or "")


def test_a_text_model_refuses_images() -> None:
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB))
    results = run(scheduler, "r", prompt_with_images([1], [2]), [image(0.25, 1)])
    assert "takes no images" in (results.finish["r"].message or "")
