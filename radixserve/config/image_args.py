"""The image-input flags of vision-language models, their checks and their command-line form.

Limits follow what a client could otherwise make the server decode: images per request, bytes of
one encoded image, and pixels of one decoded image (checked before its pixels are decoded). Local
files are read only under --allowed-local-media-path (vLLM's name) and URLs fetched only with
--enable-image-url-fetch; by default an image arrives in the request itself."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Protocol

DEFAULT_MAX_IMAGES_PER_REQUEST = 8
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


class ImageFields(Protocol):
    max_images_per_request: int
    max_image_bytes: int
    max_image_pixels: int
    allowed_local_media_path: str | None


def validate_image_args(args: ImageFields, error: type[ValueError]) -> None:
    for flag, value in (
        ("--max-images-per-request", args.max_images_per_request),
        ("--max-image-bytes", args.max_image_bytes),
        ("--max-image-pixels", args.max_image_pixels),
    ):
        if value < 1:
            raise error(f"{flag} must be >= 1, got {value}")
    root = args.allowed_local_media_path
    if root is not None and not Path(root).is_dir():
        raise error(f"--allowed-local-media-path {root!r} is not a directory")


def add_image_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("image inputs (vision-language models)")
    group.add_argument(
        "--max-images-per-request", type=int,
        help="images one request may carry",
    )  # fmt: skip
    group.add_argument(
        "--max-image-bytes", type=int,
        help="size of one encoded image (PNG, JPEG...)",
    )  # fmt: skip
    group.add_argument(
        "--max-image-pixels", type=int,
        help="width x height of one image, checked before it is decoded",
    )  # fmt: skip
    group.add_argument(
        "--allowed-local-media-path", metavar="DIR",
        help="let requests name image files under this directory (default: no local files)",
    )  # fmt: skip
    group.add_argument(
        "--enable-image-url-fetch", action="store_true",
        help="let requests name http(s) image URLs, which the server then fetches (default: refused)",
    )  # fmt: skip
