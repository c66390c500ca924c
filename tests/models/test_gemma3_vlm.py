"""Gemma 3 with images natively (`gemma3`, Gemma3ForConditionalGeneration) against transformers (float32): SigLIP,
the pooling projector and the language model over the paged cache, an image's tokens attending to each other both
ways. Logits of prompts with one and two images beside a text prompt in one batch (and of the same prompts chunked
around their images); through the shard's engine, greedy tokens for a mixed batch, for chunks the router's rule
keeps off the images, and for a cached prefix that ends inside a repeated image; a chunk ending inside an image is
refused. The tiny model's window of 3 is shorter than an image (4 tokens): the window still cuts the past while
an image's tokens see its later ones."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

from kettle.bench.drive import new_cache, scattered_tables
from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import ARCHITECTURES, load_model
from kettle.proto import generate_pb2 as pb
from kettle.router.chunk_spans import chunk_length
from kettle.router.images import tokens as image_tokens
from kettle.shard.runner import PagedRunner
from tests.models.engine_driver import BLOCK, collect, make_batch, run_to_end, warm_engine
from tests.models.family_parity import LOGITS_ATOL
from tests.vision_fixtures import GEMMA3_IMAGE_TOKENS, image_bytes, make_gemma3_folder

NEW_TOKENS = 6
PROMPTS = [  # (text, image sizes): the processor expands each <start_of_image>
    ("<|im_start|>user\nWhat is in<start_of_image><|im_end|>\n<|im_start|>assistant\n", [(40, 30)]),
    ("Hi there", []),
    ("Compare <start_of_image> with <start_of_image> please.", [(32, 32), (64, 20)]),
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import Gemma3ForConditionalGeneration

    folder = make_gemma3_folder(tmp_path_factory.mktemp("gemma3"), weights=True, sliding_window=3)
    reference = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, reference, AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def model(gemma3):
    return load_model(str(gemma3[0]), torch.float32, "cpu")


@pytest.fixture(scope="module")
def engine(gemma3):
    return warm_engine(gemma3[0])


def prepared(gemma3, text: str, sizes: list[tuple[int, int]]):
    """(processor inputs, prompt ids, pb.Image list as the router builds them, transformers' greedy tokens)."""
    _, reference, processor = gemma3
    files = [image_bytes("PNG", size, seed=i) for i, size in enumerate(sizes)]
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    token, runs, cursor = reference.config.image_token_id, [], 0
    for data in files:  # each image's run of image tokens, in order
        cursor = ids.index(token, cursor)
        digest = hashlib.blake2b(data, digest_size=16).digest()
        runs.append(pb.Image(data=data, digest=digest, start=cursor, length=GEMMA3_IMAGE_TOKENS))
        cursor += GEMMA3_IMAGE_TOKENS
    return inputs, ids, runs, out[0, len(ids) :].tolist()


def forward(model, chunks: list[list[int]], cache_lens: list[int], rows: list[torch.Tensor], cache, tables):
    """One paged forward of `chunks` (each after its `cache_lens` cached tokens), the image tokens of each chunk
    taking the next rows of `rows[i]` (its prompt's image rows from the chunk's first image token on)."""
    at, placed, values = 0, [], []
    for chunk, prompt_rows in zip(chunks, rows, strict=True):
        positions = [at + i for i, t in enumerate(chunk) if t == model.image_token_id]
        placed += positions
        values.append(prompt_rows[: len(positions)])
        at += len(chunk)
    if placed:
        model.image_rows.set(torch.tensor(placed), torch.cat(values))
    meta = AttentionMetadata.build([len(c) for c in chunks], cache_lens, tables, cache.block_size, "cpu")
    hidden = model.forward(torch.tensor([t for c in chunks for t in c]), meta.positions, cache, meta)
    return model.compute_logits(hidden)


def image_rows(model, inputs) -> torch.Tensor:
    if "pixel_values" not in inputs:
        return torch.empty(0, model.spec.hidden_size)
    return model.encode_images(inputs["pixel_values"]).reshape(-1, model.spec.hidden_size)


def test_logits_match_transformers_for_one_and_two_images_beside_text(gemma3, model):
    cases = [prepared(gemma3, *p) for p in PROMPTS]
    chunks = [case[1] for case in cases]
    assert [c.count(model.image_token_id) for c in chunks] == [GEMMA3_IMAGE_TOKENS * len(s) for _, s in PROMPTS]
    tables, blocks = scattered_tables([len(c) for c in chunks])
    rows = [image_rows(model, case[0]) for case in cases]
    logits = forward(model, chunks, [0] * 3, rows, new_cache(model, blocks), tables)
    with torch.no_grad():
        expected = torch.cat([gemma3[1](**case[0]).logits[0] for case in cases])
    torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)
    assert model.image_rows.rows is None  # placed once, then forgotten
    # An image's tokens attend to each other both ways: causal attention alone gives other logits.
    model.both_ways_token = None
    try:
        causal = forward(model, chunks, [0] * 3, rows, new_cache(model, blocks), tables)
    finally:
        model.both_ways_token = model.image_token_id
    assert (causal - expected).abs().max() > 1e-2


def test_a_prefill_in_chunks_that_hold_each_image_whole(gemma3, model):
    """Chunks of 3 tokens moved by the router's rule (`chunk_length`): each image's tokens in one chunk."""
    inputs, ids, runs, _ = prepared(gemma3, *PROMPTS[2])
    spans = [(r.start, r.start + r.length) for r in runs]
    rows = image_rows(model, inputs)
    tables, blocks = scattered_tables([len(ids)])
    cache, pieces, start = new_cache(model, blocks), [], 0
    while start < len(ids):
        size = chunk_length(start, min(3, len(ids) - start), spans)
        chunk = ids[start : start + size]
        taken = sum(t == model.image_token_id for t in ids[:start])
        pieces.append(forward(model, [chunk], [start], [rows[taken:]], cache, tables))
        start += size
    assert {len(p) for p in pieces} >= {GEMMA3_IMAGE_TOKENS}  # an image moved a chunk's end
    with torch.no_grad():
        expected = gemma3[1](**inputs).logits[0]
    torch.testing.assert_close(torch.cat(pieces), expected, atol=LOGITS_ATOL, rtol=0)


def test_the_shard_serves_it_natively_and_takes_images(engine):
    engine, info = engine
    assert info.execution_path == "native" and info.takes_images and not info.requires_padding
    assert isinstance(engine.runner, PagedRunner) and engine.runner.images is not None
    assert {"gemma3", "gemma3_text"} <= set(ARCHITECTURES) and "paligemma" not in ARCHITECTURES


def with_images(batch: pb.Batch, images: list[list[pb.Image]]) -> pb.Batch:
    for request, runs in zip(batch.requests, images, strict=True):
        request.images.extend(runs)
    return batch


def test_image_and_text_requests_in_one_batch(gemma3, engine):
    cases = [prepared(gemma3, *p) for p in PROMPTS]
    batch = with_images(make_batch(1, [c[1] for c in cases], 10, NEW_TOKENS), [c[2] for c in cases])
    tokens = run_to_end(engine[0], batch)
    assert [tokens[10 + i] for i in range(3)] == [c[3] for c in cases]


def run_in_chunks(engine, batch: pb.Batch, size: int) -> dict[int, list[int]]:
    """The batch's prompts in chunks of `size` tokens as the router cuts them (never inside an image), with the
    decodes of the requests whose prompt is complete riding along, to the end."""
    requests = {r.id: r for r in batch.requests}

    def next_chunk(request_id: int, start: int) -> int:
        request = requests[request_id]
        spans = [(i.start, i.start + i.length) for i in request.images]
        return chunk_length(start, min(size, len(request.input_ids) - start), spans)

    done = {r.id: next_chunk(r.id, 0) for r in batch.requests}
    for request in batch.requests:
        request.chunk_len = done[request.id]
    tokens: dict[int, list[int]] = {}
    cached = collect(engine.prefill(pb.PrefillRequest(batch=batch)), tokens)
    while cached:
        for request_id in cached[0].request_ids:
            if done[request_id] < len(requests[request_id].input_ids):
                cached[0].chunk_lens[request_id] = chunk = next_chunk(request_id, done[request_id])
                done[request_id] += chunk
        cached = collect(engine.decode(pb.DecodeRequest(batches=cached)), tokens)
    return tokens


def test_chunks_the_router_keeps_off_the_images(gemma3, engine):
    cases = [prepared(gemma3, *p) for p in PROMPTS]
    image_ends = [r.start + r.length for c in cases for r in c[2]]
    assert any(end % 3 for end in image_ends)  # chunks of 3 alone would end inside an image
    batch = with_images(make_batch(2, [c[1] for c in cases], 20, NEW_TOKENS), [c[2] for c in cases])
    tokens = run_in_chunks(engine[0], batch, 3)
    assert [tokens[20 + i] for i in range(3)] == [c[3] for c in cases]


def test_a_chunk_that_ends_inside_an_image_is_refused(gemma3, engine):
    _, ids, runs, _ = prepared(gemma3, *PROMPTS[0])
    batch = with_images(make_batch(3, [ids], 30, NEW_TOKENS, chunk_len=runs[0].start + 2), [runs])
    with pytest.raises(ValueError, match="ends inside image 0"):
        engine[0].prefill(pb.PrefillRequest(batch=batch))


def test_a_cached_prefix_that_ends_inside_a_repeated_image(gemma3, engine):
    """Two prompts with the same text and image before different questions; the second reads the first block from
    the cache, as the router's prefix cache hands it out, and that block ends inside the image: its next chunk
    starts inside the image and attends to the cached part of it."""
    prefix = "Look"
    while True:  # text long enough that the first block ends inside the image
        _, ids, runs, _ = prepared(gemma3, f"{prefix} <start_of_image> What is it?", [(40, 30)])
        if runs[0].start < BLOCK < runs[0].start + runs[0].length:
            break
        assert runs[0].start < BLOCK, "no prefix puts the first block's end inside the image"
        prefix += " a"
    _, _, _, expected = prepared(gemma3, f"{prefix} <start_of_image> What is it?", [(40, 30)])
    first = with_images(make_batch(4, [ids], 40, NEW_TOKENS), [runs])
    assert run_to_end(engine[0], first)[40] == expected
    _, again_ids, again_runs, again_expected = prepared(gemma3, f"{prefix} <start_of_image> Which colour?", [(40, 30)])
    assert again_ids[:BLOCK] == ids[:BLOCK] and again_runs[0].start == runs[0].start
    again = with_images(make_batch(5, [again_ids], 41, NEW_TOKENS), [again_runs])
    again.requests[0].blocks[0] = first.requests[0].blocks[0]
    again.requests[0].cache_len = BLOCK
    assert run_to_end(engine[0], again)[41] == again_expected


def test_the_routers_image_tokens_are_its_processors(gemma3):
    """The router (no processor, no torch) writes a Gemma 3 image as the processor does, so its ids are the ones the
    shard's model reads, and keeps each image whole when it chunks a prompt."""
    folder, _, processor = gemma3
    tokens = image_tokens.for_model(folder)
    text = "Describe <start_of_image> please"
    expanded = text.replace(tokens.marker, tokens.expand(40, 30))
    ids = AutoTokenizer.from_pretrained(folder)(expanded)["input_ids"]
    image = Image.open(io.BytesIO(image_bytes("PNG", (40, 30)))).convert("RGB")
    assert ids == processor(text=text, images=[image], return_tensors="pt")["input_ids"][0].tolist()
    assert tokens.count(40, 30) == GEMMA3_IMAGE_TOKENS and tokens.whole
