"""Chunked prefill of prompts with images a model computes whole (Gemma 3 attends an image's tokens both ways):
the router's chunks never end inside such an image, step by step against the scripted shards. A chunk that would
end inside one ends before it; one that starts at it runs to its end, past the budget if it must, and nothing
else joins that step; images of other families are still cut anywhere."""

from __future__ import annotations

import asyncio
import dataclasses

from kettle.router.chunk_spans import chunk_length
from kettle.router.queue import Entry
from kettle.router.types import PromptImage
from tests.unit.fake_client import FakeClient, make_entry, make_request
from tests.unit.test_chunked_prefill import run_until_idle, setup


def entry_with_image(entry_id: int, input_len: int, start: int, length: int, whole: bool = True) -> Entry:
    image = PromptImage(b"png", b"digest", start, length, whole)
    return Entry(entry_id, dataclasses.replace(make_request(input_len, max_new=2), images=(image,)))


def test_a_chunk_ends_before_an_image_or_runs_to_its_end():
    spans = [(5, 13), (20, 24)]
    assert chunk_length(0, 4, spans) == 4  # ends before the first image
    assert chunk_length(0, 5, spans) == 5  # ends exactly where it starts
    assert chunk_length(4, 4, spans) == 1  # would end inside: cut before it
    assert chunk_length(5, 4, spans) == 8  # starts at it: the whole image, past the 4 asked
    assert chunk_length(7, 2, spans) == 6  # starts inside (a cached prefix ended there): to its end
    assert chunk_length(13, 10, spans) == 7  # cut before the second image
    assert chunk_length(13, 11, spans) == 11  # ends where it ends
    assert chunk_length(0, 30, []) == 30


def test_the_scheduler_never_ends_a_chunk_inside_a_whole_image():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, budget=4)
        running, image = make_entry(1, input_len=3, max_new=8), entry_with_image(2, input_len=16, start=5, length=8)
        queue.append(running)
        await scheduler.step()
        queue.append(image)
        await run_until_idle(scheduler)
        chunks = [f[0][2] for f in client.forwards if 2 in f[0]]
        assert chunks == [4, 1, 8, 3]  # [0, 4), [4, 5) before the image, the image [5, 13) whole, the rest
        assert all(decoded == [1] for prompts, decoded in client.forwards[1:5]), "decodes ride along every chunk"

    asyncio.run(main())


def test_nothing_joins_a_step_whose_chunk_stops_before_an_image():
    """The running prefill's chunk is cut short of its budget: the budget it leaves is not handed to new requests,
    so at most one prompt is ever in progress."""

    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, budget=8)
        queue.append(entry_with_image(1, input_len=12, start=2, length=8))
        await scheduler.step()  # [0, 2): the image would not fit in what is left of the 8
        queue.append(make_entry(2, input_len=3, max_new=2))
        await run_until_idle(scheduler)
        prompts = [f[0] for f in client.forwards]
        assert prompts[:3] == [{1: 2}, {1: 8}, {1: 2, 2: 3}]

    asyncio.run(main())


def test_a_new_request_whose_first_chunk_would_pass_the_budget_waits_for_the_next_step():
    """An image at the start of a prompt (after a cached prefix, say) makes its first chunk the whole image: it may
    pass the budget only as a step's first chunk."""

    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, budget=6)
        queue.append(make_entry(1, input_len=4, max_new=2))
        queue.append(entry_with_image(2, input_len=12, start=0, length=8))
        await run_until_idle(scheduler)
        prompts = [f[0] for f in client.forwards]
        assert prompts[:3] == [{1: 4}, {2: 8}, {2: 4}]

    asyncio.run(main())


def test_images_of_other_families_are_cut_anywhere():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, budget=4)
        queue.append(entry_with_image(1, input_len=16, start=5, length=8, whole=False))
        await run_until_idle(scheduler)
        assert [f[0][1] for f in client.forwards if 1 in f[0]] == [4, 4, 4, 4]

    asyncio.run(main())
