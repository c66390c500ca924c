"""Where a prompt chunk may end: never inside a span of the prompt that the model computes whole.

A model that lets an image's tokens attend to each other both ways (Gemma 3) computes each of them from all the
others, so a chunked prefill must bring every token of the image that is not cached yet in one chunk
(`PromptImage.whole`). A chunk that would end inside such a span ends just before it instead; one that starts at
or inside it (a cached prefix can end inside an image) runs to its end, past the step's budget if it must: a
step's budget is a target, and an image is at most a few hundred tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


def chunk_length(start: int, wanted: int, spans: Sequence[tuple[int, int]]) -> int:
    """The length of the chunk from prompt position `start` that takes `wanted` tokens (> 0), moved so that it
    does not end inside any of `spans` ([begin, end) positions, disjoint)."""
    end = start + wanted
    for begin, stop in spans:
        if begin < end < stop:
            return begin - start if begin > start else stop - start
    return wanted
