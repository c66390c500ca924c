"""The paged runner of a model that reads images: each forward first gets its image rows (`ImageInputs`).
Everything else, decode steps included, is the paged runner's."""

from __future__ import annotations

from kettle.shard.image_inputs import ImageInputs
from kettle.shard.runner import PagedRunner


class ImageRunner(PagedRunner):
    def __init__(self, model, vocab, device, watermark, graph_buckets, images: ImageInputs) -> None:
        super().__init__(model, vocab, device, watermark, graph_buckets)
        self.images = images

    def _forward(self, requests, queries, drafts):
        if any(request.images and request.in_prefill for request in requests):
            self.images.place(requests, queries)
        try:
            return super()._forward(requests, queries, drafts)
        finally:
            self.model.image_rows.clear()  # a forward that failed before embedding must not leave rows behind
