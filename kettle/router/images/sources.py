"""Where the images of a prompt are: TGI's Markdown images in `/generate` inputs, and OpenAI's `image_url`
content parts in chat messages. Both become `ImageRef`s, in the order the model reads them."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kettle.router.errors import ValidationError

# TGI's syntax: `![alt](url)`; the URL runs to the first closing parenthesis or space.
MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class ImageRef:
    """One image a prompt refers to: a `data:` URL or an `http(s)` URL, not read yet."""

    url: str


def split_markdown(inputs: str) -> list[str | ImageRef]:
    """`inputs` as text pieces and images, in order; text without images is one piece (an empty input none)."""
    pieces: list[str | ImageRef] = []
    start = 0
    for match in MARKDOWN_IMAGE.finditer(inputs):
        if match.start() > start:
            pieces.append(inputs[start : match.start()])
        pieces.append(ImageRef(match.group(1)))
        start = match.end()
    if start < len(inputs):
        pieces.append(inputs[start:])
    return pieces


def image_part_url(part: dict[str, Any]) -> str | None:
    """The URL of an OpenAI `image_url` content part (`{"image_url": {"url": ...}}`, or the older bare string), or
    None when the part carries none."""
    value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) and value else None


def chat_images(contents: Iterable[Any]) -> list[ImageRef]:
    """The images of a conversation's message contents (each a string or a list of part dicts), in order."""
    refs = []
    for content in contents:
        for part in content if isinstance(content, list) else ():
            if part.get("type") != "image_url":
                continue
            if (url := image_part_url(part)) is None:
                raise ValidationError("an `image_url` content part needs its `image_url.url`")
            refs.append(ImageRef(url))
    return refs
