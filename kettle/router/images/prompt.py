"""A prompt with images: the images read and checked, their markers expanded into image tokens, and after
tokenizing, where each image's run of tokens lies in the prompt's ids (`PromptImage`, what the shard and the
prefix cache receive)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kettle.router.errors import ValidationError
from kettle.router.images.check import CheckedImage, ImageLimits, check_count, check_image
from kettle.router.images.fetch import FetchPolicy, read_image_bytes
from kettle.router.images.sources import ImageRef, split_markdown
from kettle.router.images.tokens import ImageTokens
from kettle.router.types import PromptImage


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's text with every image expanded into its tokens, and the images in order."""

    text: str
    images: tuple[CheckedImage, ...]


class ImageReader:
    """Reads the images of prompts for one model (its `ImageTokens`) under the server's limits and fetch rules."""

    def __init__(self, tokens: ImageTokens, limits: ImageLimits, policy: FetchPolicy) -> None:
        self.tokens = tokens
        self.limits = limits
        self.policy = policy

    async def read(self, refs: Sequence[ImageRef]) -> tuple[CheckedImage, ...]:
        """The images of `refs`, checked; the count is checked before any is read."""
        check_count(len(refs), self.limits)
        policy = FetchPolicy(self.policy.enabled, min(self.policy.max_bytes, self.limits.max_bytes),
                             self.policy.timeout_s, self.policy.max_redirects)  # fmt: skip
        datas = await asyncio.gather(*(read_image_bytes(ref.url, policy, i) for i, ref in enumerate(refs)))
        return tuple(
            await asyncio.gather(
                *(asyncio.to_thread(check_image, data, self.limits, i) for i, data in enumerate(datas))
            )
        )

    async def markdown(self, inputs: str) -> ImagePrompt:
        """TGI's `/generate` inputs: each Markdown image becomes the family's image text."""
        pieces = split_markdown(inputs)
        images = await self.read([p for p in pieces if isinstance(p, ImageRef)])
        it = iter(images)
        text = "".join(p if isinstance(p, str) else _markdown(self.tokens, next(it)) for p in pieces)
        return ImagePrompt(text, images)

    async def chat(self, rendered: str, refs: Sequence[ImageRef]) -> ImagePrompt:
        """A rendered chat prompt whose template wrote one marker per image part: each marker expanded."""
        images = await self.read(refs)
        pieces = rendered.split(self.tokens.marker)
        if len(pieces) - 1 != len(images):
            raise ValidationError(
                f"the chat template wrote {len(pieces) - 1} image markers ({self.tokens.marker}) for "
                f"{len(images)} images: a message's text may not contain the marker itself"
            )
        expanded = [self.tokens.expand(image.width, image.height) for image in images]
        text = pieces[0] + "".join(e + p for e, p in zip(expanded, pieces[1:], strict=True))
        return ImagePrompt(text, images)

    def locate(self, input_ids: Sequence[int], images: Sequence[CheckedImage]) -> tuple[PromptImage, ...]:
        """Each image's first image token and count of them in the tokenized prompt, in order (one run for LLaVA;
        tiles between tags for Idefics3: an image's tokens are the first `count` image tokens from its start);
        422 when they do not add up (truncation that reaches into an image)."""
        token = self.tokens.image_token_id
        where = [i for i, t in enumerate(input_ids) if t == token]
        lengths = [self.tokens.count(image.width, image.height) for image in images]
        if len(where) != sum(lengths):
            raise ValidationError("the prompt's image tokens do not match its images (truncated into an image?)")
        found, at = [], 0
        for image, length in zip(images, lengths, strict=True):
            found.append(PromptImage(image.data, image.digest, where[at], length, self.tokens.whole))
            at += length
        return tuple(found)


def _markdown(tokens: ImageTokens, image: CheckedImage) -> str:
    return tokens.markdown(image.width, image.height)
