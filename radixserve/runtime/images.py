"""Image inputs on the engine's side: reading what a client names, checking it against the
server's limits, running the model's image processor and placing each image's tokens.

A client names an image as a `data:` URL, bare base64, a local file path (only under
--allowed-local-media-path) or an http(s) URL (only with --enable-image-url-fetch). Every refusal is
an InvalidRequestError (a 400 naming the problem); nothing here is fetched unless a flag allows it.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.models.config import VisionConfig
from radixserve.protocol.messages import ImageInput, image_digest
from radixserve.protocol.sampling_params import InvalidRequestError

logger = logging.getLogger("radixserve")

# How long an allowed URL fetch may take.
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ImageLimits:
    max_images: int  # per request
    max_bytes: int  # of one encoded image
    max_pixels: int  # width x height of one decoded image
    allowed_local_media_path: Path | None = None
    allow_url_fetch: bool = False


def _read_url(url: str, limits: ImageLimits) -> bytes:
    if not limits.allow_url_fetch:
        raise InvalidRequestError(
            "image URLs are not fetched unless the server runs with --enable-image-url-fetch; "
            "send the image as a data: URL"
        )
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
            data: bytes = response.read(limits.max_bytes + 1)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"could not fetch the image at {url!r}: {exc}") from exc
    return data


def _read_local(spec: str, limits: ImageLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise InvalidRequestError(
            "local image paths are refused unless the server runs with --allowed-local-media-path"
        )
    path = Path(spec.removeprefix("file://")).resolve()
    if not path.is_relative_to(root):
        raise InvalidRequestError(f"image path {spec!r} is outside --allowed-local-media-path")
    try:
        with path.open("rb") as f:
            return f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise InvalidRequestError(f"could not read image {spec!r}: {exc.strerror}") from exc


def read_image_bytes(spec: Any, limits: ImageLimits) -> bytes:
    """The encoded image a client names (see the module doc), within limits.max_bytes."""
    if not isinstance(spec, str) or not spec:
        raise InvalidRequestError("an image must be a data: URL, base64, a URL or a file path")
    if spec.startswith("data:"):
        header, sep, payload = spec.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidRequestError("an image data: URL must be base64 (data:image/...;base64,...)")
        data = _b64(payload, limits)
    elif spec.startswith(("http://", "https://")):
        data = _read_url(spec, limits)
    elif spec.startswith(("/", "file://", "./", "../")):
        data = _read_local(spec, limits)
    else:
        data = _b64(spec, limits)
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(f"an image is larger than {limits.max_bytes} bytes (--max-image-bytes)")
    return data


def _b64(payload: str, limits: ImageLimits) -> bytes:
    # Base64 is 4 characters per 3 bytes: a longer payload is over the limit before decoding it.
    if len(payload) > (limits.max_bytes // 3 + 1) * 4 + 4:
        raise InvalidRequestError(f"an image is larger than {limits.max_bytes} bytes (--max-image-bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"an image is not valid base64: {exc}") from exc


def decode_image(data: bytes, limits: ImageLimits) -> Any:
    """An RGB PIL image, refused before its pixels are decoded when it has too many."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns first; the pixel limit below is the one that applies.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > limits.max_pixels:
                message = f"an image has {width}x{height} pixels, more than {limits.max_pixels}"
                raise InvalidRequestError(message + " (--max-image-pixels)")
            image.load()
            return image.convert("RGB")
    except InvalidRequestError:
        raise
    except Exception as exc:  # PIL raises many types (OSError, SyntaxError, ValueError...) for bad data
        raise InvalidRequestError(f"the image could not be decoded: {exc}") from exc


class ImagePreprocessor:
    """A vision-language model's image processor and image token layout."""

    def __init__(self, model_dir: Path, vision: VisionConfig, limits: ImageLimits):
        from transformers import AutoImageProcessor

        self.vision = vision
        self.limits = limits
        with warnings.catch_warnings():
            # Without torchvision transformers falls back to its PIL processors, and says so.
            warnings.simplefilter("ignore")
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        logger.info(
            "images: %s, %d tokens each, at most %d per request",
            type(self.processor).__name__,
            vision.tokens_per_image,
            limits.max_images,
        )

    def pixel_values(self, image: Any) -> np.ndarray:
        out = self.processor(images=[image], return_tensors="np")
        pixels: np.ndarray = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
        expected = (self.vision.num_channels, self.vision.image_size, self.vision.image_size)
        if pixels.shape != expected:
            raise InvalidRequestError(f"the image processor made {pixels.shape}, the model takes {expected}")
        return pixels

    def expand(self, ids: list[int], images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """ids with each image token expanded to the model's tokens per image, and the images as
        the scheduler takes them. The prompt must hold one image token per image, in order."""
        token, per_image = self.vision.image_token_id, self.vision.tokens_per_image
        if len(images) > self.limits.max_images:
            message = f"{len(images)} images, at most {self.limits.max_images} per request"
            raise InvalidRequestError(message + " (--max-images-per-request)")
        places = [i for i, t in enumerate(ids) if t == token]
        if len(places) != len(images):
            raise InvalidRequestError(
                f"the prompt has {len(places)} image tokens for {len(images)} images; put one image "
                "token per image where it belongs (chat requests do this themselves)"
            )
        out: list[int] = []
        inputs: list[ImageInput] = []
        last = 0
        for place, spec in zip(places, images, strict=True):
            out += ids[last:place]
            pixels = self.pixel_values(decode_image(read_image_bytes(spec, self.limits), self.limits))
            raw, shape = pixels.tobytes(), list(pixels.shape)
            inputs.append(ImageInput(image_digest(shape, raw), raw, shape, len(out)))
            out += [token] * per_image
            last = place + 1
        return out + ids[last:], inputs
