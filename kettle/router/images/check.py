"""An image's bytes checked against the limits: format, pixels, and that it decodes; `ImageLimits` holds them.

Pillow reads the header first, so a huge image is refused by its size before any pixel is decoded; then the
first frame is decoded (off the event loop), so a truncated or corrupt file is a 422 here and not a failed step
in the shard. A GIF's first frame is its image, as TGI and OpenAI read it.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

from kettle.router.errors import ValidationError

# Pillow's format names → the names messages use.
FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF"}


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per request
    max_bytes: int = 20 * 1024 * 1024  # per image, as sent (decoded from base64)
    max_pixels: int = 4096 * 4096  # per image, width x height


@dataclass(frozen=True)
class CheckedImage:
    """An image that passed the checks: its bytes, their digest (the prefix cache's and the shard's key), its format
    and size."""

    data: bytes
    digest: bytes
    format: str
    width: int
    height: int


def check_count(count: int, limits: ImageLimits) -> None:
    if count > limits.max_images:
        raise ValidationError(f"a request may carry at most {limits.max_images} images. Given: {count}")


def check_image(data: bytes, limits: ImageLimits, index: int = 0) -> CheckedImage:
    """The image in `data`, or a 422 naming what is wrong with it (blocking: decodes the first frame)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ValidationError(
            f"image {index} is larger than the limit of {limits.max_bytes} bytes. Given: {len(data)} bytes"
        )
    try:
        image = Image.open(io.BytesIO(data), formats=None)
    except Image.DecompressionBombError:
        raise ValidationError(f"image {index} has more than {limits.max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise ValidationError(f"image {index} is not an image this server reads (PNG, JPEG, WebP, GIF)") from None
    with image:
        if image.format not in FORMATS:
            raise ValidationError(
                f"image {index} is {image.format}, not a format this server reads (PNG, JPEG, WebP, GIF)"
            )
        width, height = image.size
        if width * height > limits.max_pixels:
            raise ValidationError(
                f"image {index} has more than {limits.max_pixels} pixels. Given: {width}x{height} = {width * height}"
            )
        try:
            image.seek(0)
            image.load()
        except (OSError, ValueError, EOFError, Image.DecompressionBombError):
            raise ValidationError(
                f"image {index} does not decode: the {FORMATS[image.format]} file is damaged"
            ) from None
        return CheckedImage(data, hashlib.blake2b(data, digest_size=16).digest(), FORMATS[image.format], width, height)
