"""The images of a step's prompts, on the shard: decoded and preprocessed with the model's own image processor
(transformers' PIL backend), encoded by the model's vision tower in one batch per step, and handed to the model
as the embedding rows of the step's image tokens (`ImageRows`).

An image is encoded by the first step whose prompt chunk reaches its tokens, and its rows are kept with the
request (`RequestState.image_rows`) until a chunk has taken the last of them: a prefill chunked inside an image
encodes it once. A prefix read from the cache that ends inside an image leaves only the rows after it to place.
A model whose image tokens attend to each other both ways (`both_ways_token`: Gemma 3) needs the rest of an image
in one chunk: a chunk that ends inside one is refused (the router never sends one).

A model with multimodal rotary positions (`rope_positions`: Qwen2-VL's M-RoPE) also gets every token's three
position components for each step of a request with images: the prompt's, computed once per request from its
images' grids (the image processor's resize of each image's size, read from its header) and kept with it
(`RequestState.rope`), and for the tokens after the prompt their index plus the request's offset.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import torch

from kettle.shard.batch import RequestState


def load_image_processor(folder: str):
    """The model's image processor; transformers picks its PIL backend where torchvision is absent."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder)


def decoded(files: Sequence[bytes]) -> list:
    """The images of `files` as PIL images in RGB (a GIF's first frame), as the image processors take them."""
    from PIL import Image

    images = []
    for data in files:
        with Image.open(io.BytesIO(data)) as image:
            image.seek(0)  # a GIF's first frame
            images.append(image.convert("RGB"))
    return images


class ImageInputs:
    """Places the image rows of each step for a model with `encode_images` and `image_rows`."""

    def __init__(self, model, processor) -> None:
        self.model = model
        self.processor = processor

    def features(self, files: Sequence[bytes]) -> dict:
        """The image processor's batch for `files` (pixel values, and what else the model's tower reads)."""
        images = decoded(files)
        nested = getattr(self.model, "image_batches_nested", False)  # Idefics3: a list of tiles per image
        batch = self.processor(images=[[image] for image in images] if nested else images, return_tensors="pt")
        wanted = ("pixel_values", "pixel_attention_mask", "image_sizes", "image_grid_thw")  # what the towers read
        return {key: value for key, value in batch.items() if key in wanted}

    def positions(self, request: RequestState, index: int) -> list[int]:
        """The prompt positions of image `index`'s tokens: the first `length` image tokens from its start (one run
        for LLaVA; tiles between tags for Idefics3)."""
        image, token, ids = request.images[index], self.model.image_token_id, request.all_ids
        found, at = [], image.start
        while len(found) < image.length:
            if ids[at] == token:
                found.append(at)
            at += 1
        return found

    def place(self, requests: Sequence[RequestState], queries: Sequence[Sequence[int]]) -> bool:
        """Sets the model's image rows for a step of `queries` (each request's tokens, in the step's order) and, for
        an M-RoPE model, the step's rotary positions; True when it set those (a decode graph, captured with plain
        positions, cannot run the step)."""
        spans = [
            (request, request.cache_len, request.cache_len + len(query) if request.in_prefill else 0)
            for request, query in zip(requests, queries, strict=True)
        ]
        if getattr(self.model, "both_ways_token", None) is not None:
            _check_whole(spans)
        self._encode(spans)
        rows, values, offset = [], [], 0
        for (request, low, high), query in zip(spans, queries, strict=True):
            for index in range(len(request.images)):
                if not self._reached(request, index, low, high):
                    continue
                positions = self.positions(request, index)
                taken = [j for j, position in enumerate(positions) if low <= position < high]
                rows.extend(offset + positions[j] - low for j in taken)
                values.append(request.image_rows[index][taken[0] : taken[-1] + 1])
                if positions[-1] < high:  # its last rows are placed: nothing later reads them
                    del request.image_rows[index]
            offset += len(query)
        if rows:
            self.model.image_rows.set(torch.tensor(rows, dtype=torch.long), torch.cat(values))
        return self._rope(requests, queries)

    def window(self, requests: Sequence[RequestState]) -> None:
        """For an M-RoPE model, the offset of each request's tokens after its prompt, for a greedy window."""
        holder = getattr(self.model, "rope_positions", None)
        if holder is not None:
            holder.set(torch.tensor([self._prompt_rope(r)[1] if r.images else 0 for r in requests]))

    def clear(self) -> None:
        """Forgets what `place` or `window` set (after the forward, which may have failed before reading it)."""
        self.model.image_rows.clear()
        holder = getattr(self.model, "rope_positions", None)
        if holder is not None:
            holder.clear()

    def _rope(self, requests: Sequence[RequestState], queries: Sequence[Sequence[int]]) -> bool:
        """Sets the step's [3, tokens] rotary positions of an M-RoPE model (False for other models)."""
        holder = getattr(self.model, "rope_positions", None)
        if holder is None:
            return False
        columns = []
        for request, query in zip(requests, queries, strict=True):
            start, end = request.cache_len, request.cache_len + len(query)
            prompt, offset = self._prompt_rope(request) if request.images else (None, 0)
            middle = start if prompt is None else min(max(start, prompt.shape[1]), end)  # [start, middle): prompt's
            if start < middle:
                columns.append(prompt[:, start:middle])
            if middle < end:
                columns.append((torch.arange(middle, end) + offset).expand(3, -1))
        holder.set(torch.cat(columns, dim=1))
        return True

    def _prompt_rope(self, request: RequestState) -> tuple[torch.Tensor, int]:
        """The request's prompt positions and decode offset (computed on first use, then kept with it)."""
        if request.rope is None:
            from PIL import Image

            grids = []
            for image in request.images:
                with Image.open(io.BytesIO(image.data)) as opened:  # the header only: its size
                    grids.append((image.start, image.length, self.model.image_grid(self.processor, *opened.size)))
            request.rope = self.model.prompt_rope(request.prompt_len, grids)
        return request.rope

    def _reached(self, request: RequestState, index: int, low: int, high: int) -> bool:
        """Whether the step's prompt tokens [low, high) hold some of image `index`'s tokens."""
        return request.images[index].start < high and self.positions(request, index)[-1] >= low

    def _encode(self, spans: list[tuple[RequestState, int, int]]) -> None:
        """Encodes, in one batch, every image the step reaches that its request does not hold rows for."""
        wanted = [
            (request, index)
            for request, low, high in spans
            for index in range(len(request.images))
            if index not in request.image_rows and self._reached(request, index, low, high)
        ]
        if not wanted:
            return
        encoded = self.model.encode_images(**self.features([request.images[index].data for request, index in wanted]))
        for (request, index), rows in zip(wanted, encoded, strict=True):
            if rows.shape[0] != request.images[index].length:
                raise ValueError(
                    f"image {index} of request {request.id} encodes to {rows.shape[0]} rows, but the prompt has "
                    f"{request.images[index].length} image tokens for it"
                )
            request.image_rows[index] = rows


def _check_whole(spans: list[tuple[RequestState, int, int]]) -> None:
    """Raises when a prompt chunk [low, high) ends inside an image: its tokens would miss the image's later ones."""
    for request, low, high in spans:
        for index, image in enumerate(request.images):
            if low < high < request.prompt_len and image.start < high < image.start + image.length:
                raise ValueError(
                    f"request {request.id}: a prefill chunk ends inside image {index} (tokens {image.start} to "
                    f"{image.start + image.length - 1}), whose tokens the model attends both ways: send it whole"
                )
