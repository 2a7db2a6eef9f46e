"""Image inputs of vision-language models, on the scheduler's side.

A prompt's images arrive as pixel values with a content digest (protocol ImageInput), each one's
tokens already expanded in the prompt. Here each image's tokens get stand-in ids derived from its
digest, so the radix cache, the storage tier and KV events key an image by its content: equal
images share K/V, different ones never do. The vision encoder runs lazily, for the images whose
tokens a prefill chunk computes: an image whose K/V the cache already holds is never encoded, and
its embeddings are dropped once its tokens have K/V (a retracted request encodes it again).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from radixserve.executor.base import Executor, ImageEncoding, MissingCapabilityError
from radixserve.protocol.messages import ImageInput, image_digest
from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.scheduler.request import IMAGE_ID_BASE, ImageSpan, Req


def stand_in_ids(digest: str, length: int) -> list[int]:
    """An image's token ids as the cache sees them: a hash of its digest and the position in the
    image, so two images' keys differ at their first token unless their contents are equal."""
    seed = bytes.fromhex(digest)
    ids = []
    for pos in range(length):
        h = hashlib.blake2b(seed + pos.to_bytes(4, "little"), digest_size=4).digest()
        ids.append(IMAGE_ID_BASE | (int.from_bytes(h, "little") & (IMAGE_ID_BASE - 1)))
    return ids


def image_rows(req: Req, start: int, n: int) -> list[tuple[int, torch.Tensor]]:
    """The embeddings of req's image tokens among prompt positions [start, start + n), as
    (row within that range, vectors) pairs for ForwardBatch.input_embeds."""
    rows = []
    for span in req.images:
        first, end = max(start, span.offset), min(start + n, span.end)
        if first < end:
            assert span.embeds is not None, "ImageEncoder.prepare runs before the batch is built"
            rows.append((first - start, span.embeds[first - span.offset : end - span.offset]))
    return rows


class ImageEncoder:
    """Turns a request's ImageInputs into ImageSpans and runs the vision encoder when needed."""

    def __init__(
        self, executor: ImageEncoding, image_token_id: int, tokens_per_image: int, image_shape: list[int]
    ):
        self.executor = executor
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.image_shape = image_shape
        # Images encoded and tokens placed (get_server_info / metrics).
        self.images_encoded = 0

    def attach(self, req: Req, images: list[ImageInput]) -> None:
        """Checks each image against the prompt (a scheduler may be driven without the engine's
        checks) and replaces its tokens with stand-in ids. Refusals are InvalidRequestError."""
        ids = req.origin_input_ids
        spans: list[ImageSpan] = []
        for image in images:
            start, end = image.offset, image.offset + self.tokens_per_image
            if (spans and start < spans[-1].end) or start < 0 or end > len(ids):
                raise InvalidRequestError("image offsets overlap or fall outside the prompt")
            if any(t != self.image_token_id for t in ids[start:end]):
                message = f"an image's {self.tokens_per_image} positions must hold the image token"
                raise InvalidRequestError(f"{message} {self.image_token_id}")
            if list(image.shape) != self.image_shape:
                raise InvalidRequestError(f"image pixel values must have shape {self.image_shape}")
            expected = int(np.prod(image.shape)) * 4
            if len(image.pixel_values) != expected:
                raise InvalidRequestError("image pixel values do not match their shape")
            pixels = np.frombuffer(image.pixel_values, dtype=np.float32).reshape(image.shape)
            digest = image_digest(image.shape, image.pixel_values)
            if digest != image.digest:
                raise InvalidRequestError("an image's digest does not match its pixel values")
            spans.append(ImageSpan(start, self.tokens_per_image, digest, torch.from_numpy(pixels.copy())))
        stray = sum(t == self.image_token_id for t in ids) - len(spans) * self.tokens_per_image
        if stray:
            raise InvalidRequestError("the prompt holds image tokens that no image fills")
        for span in spans:
            ids[span.offset : span.end] = stand_in_ids(span.digest, span.length)
        req.images = spans

    def prepare(self, reqs: list[Req]) -> None:
        """Encodes, in one call, the images whose tokens the coming extend computes
        (positions [kv_len, kv_len + extend_len) of each request) and that have no embeddings."""
        todo = [
            span
            for req in reqs
            for span in req.images
            if span.embeds is None and span.offset < req.kv_len + req.extend_len and span.end > req.kv_len
        ]
        if not todo:
            return
        embeds = self.executor.encode_images(torch.stack([s.pixel_values for s in todo]))
        for span, vectors in zip(todo, embeds, strict=True):
            span.embeds = vectors
        self.images_encoded += len(todo)

    @staticmethod
    def release(reqs: list[Req]) -> None:
        """Drops the embeddings of images whose tokens all have K/V now."""
        for req in reqs:
            for span in req.images:
                if span.embeds is not None and span.end <= req.kv_len:
                    span.embeds = None


def image_support(
    executor: Executor, speculative: bool, disaggregated: bool, pipeline_stages: int
) -> tuple[ImageEncoder | None, str]:
    """The encoder of a vision-language model's images, or None and why image requests are
    refused: the model takes none, or the server runs with a feature that cannot carry them
    (drafts and the decode half of a handoff see only token ids; only the first pipeline stage
    places embeddings, which no test has covered yet)."""
    vision = executor.info.config.vision
    if vision is None:
        return None, "this model takes no images"
    for refused, flag in (
        (speculative, "--speculative-algorithm"),
        (disaggregated, "--disaggregation-mode"),
        (pipeline_stages > 1, "--pp-size > 1"),
    ):
        if refused:
            return None, f"images are not supported with {flag}"
    if not isinstance(executor, ImageEncoding):
        raise MissingCapabilityError(executor, ImageEncoding, "a vision-language model")
    shape = [vision.num_channels, vision.image_size, vision.image_size]
    return ImageEncoder(executor, vision.image_token_id, vision.tokens_per_image, shape), ""
