"""Qwen2-VL and Qwen2.5-VL natively: Kettle's vision tower (2-D RoPE, the patch merger; Qwen2.5-VL's windows,
RMSNorm and gated MLPs), placed image rows and the language model's multimodal rotary positions (M-RoPE) over the
paged cache, against transformers' Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration (float32):
the prompt's positions and decode offset, logits for prompts with one and two images beside a text-only prompt in
one batch, decode steps' logits (after the image the positions run behind the token count); and through the
shard's engine, as the router sends requests: an image and a text request batched, chunks that end inside images,
prefixes read from the cache that end inside or after an image, and greedy windows of decode steps in one C call.
"""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from PIL import Image

from kettle.bench.drive import new_cache, scattered_tables, step
from kettle.kernels import ops
from kettle.models.registry import load_model
from kettle.proto import generate_pb2 as pb
from kettle.shard.image_inputs import load_image_processor
from tests.models.engine_driver import BLOCK, collect, make_batch, run_to_end, warm_engine
from tests.models.family_parity import LOGITS_ATOL, assert_prompt_logits
from tests.vision_fixtures import image_bytes, make_qwen2_vl_folder, qwen2_vl_inputs

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [  # (text, image sizes): 40 x 30 takes 20 image tokens, 64 x 20 16 (a 4 x 16 grid), 100 x 80 56 (resized)
    (f"<|im_start|>user\n{IMAGE}What is in the picture?<|im_end|>\n", [(40, 30)]),
    ("Hi there", []),
    (f"Compare {IMAGE} with {IMAGE} please.", [(64, 20), (100, 80)]),
]
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    """(folder, Kettle's model, transformers' model) of a tiny Qwen2-VL or Qwen2.5-VL."""
    import transformers

    folder = make_qwen2_vl_folder(tmp_path_factory.mktemp(request.param), weights=True, kind=request.param)
    name = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[request.param]
    reference = getattr(transformers, f"{name}ForConditionalGeneration").from_pretrained(folder, dtype=torch.float32)
    return folder, load_model(str(folder), torch.float32, "cpu"), reference.eval()


def files_of(sizes) -> list[bytes]:
    return [image_bytes("PNG", size, seed=i) for i, size in enumerate(sizes)]


def image_runs(model, processor, ids: list[int], files: list[bytes]) -> list[tuple[int, int, tuple[int, int, int]]]:
    """Each image's (first image token, image tokens, patch grid), the grid from the image's size as the shard
    computes it."""
    where = [i for i, t in enumerate(ids) if t == model.image_token_id]
    runs, at = [], 0
    for data in files:
        grid = model.image_grid(processor, *Image.open(io.BytesIO(data)).size)
        length = grid[0] * grid[1] * grid[2] // model.merge**2
        runs.append((where[at], length, grid))
        at += length
    assert at == len(where)
    return runs


def test_positions_and_grids_match_transformers(qwen):
    folder, model, reference = qwen
    processor = load_image_processor(str(folder))
    files = files_of(PROMPTS[2][1])
    inputs = qwen2_vl_inputs(folder, PROMPTS[2][0], files)
    ids = inputs["input_ids"][0].tolist()
    runs = image_runs(model, processor, ids, files)
    assert [list(run[2]) for run in runs] == inputs["image_grid_thw"].tolist()
    positions, delta = model.prompt_rope(len(ids), runs)
    expected, deltas = reference.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    assert torch.equal(positions, expected[:, 0]) and delta == int(deltas) < 0


def test_logits_match_transformers_for_one_and_two_images_beside_text(qwen):
    folder, model, reference = qwen
    processor = load_image_processor(str(folder))
    all_files = [files_of(sizes) for _, sizes in PROMPTS]
    all_inputs = [qwen2_vl_inputs(folder, text, files) for (text, _), files in zip(PROMPTS, all_files, strict=True)]
    chunks = [inputs["input_ids"][0].tolist() for inputs in all_inputs]
    # Every image of the step encoded in one batch, as the shard does; their rows at the image tokens.
    files = [f for fs in all_files for f in fs]
    batch = processor(images=[Image.open(io.BytesIO(f)) for f in files], return_tensors="pt")
    rows = torch.cat(model.encode_images(batch["pixel_values"], batch["image_grid_thw"]))
    flat = [t for chunk in chunks for t in chunk]
    assert rows.shape[0] == flat.count(model.image_token_id) == 20 + 16 + 56
    model.image_rows.set(torch.tensor([i for i, t in enumerate(flat) if t == model.image_token_id]), rows)
    positions = [
        model.prompt_rope(len(ids), image_runs(model, processor, ids, fs))[0]
        for ids, fs in zip(chunks, all_files, strict=True)
    ]
    model.rope_positions.set(torch.cat(positions, dim=1))
    tables, blocks = scattered_tables([len(c) for c in chunks])
    logits, _ = step(model, new_cache(model, blocks), chunks, [0] * 3, tables)
    assert model.image_rows.rows is None and model.rope_positions.value is None  # used once, then forgotten
    assert_prompt_logits(logits, reference, all_inputs, chunks)


def test_decode_steps_continue_from_the_offset(qwen):
    """Prefill, then decode steps at index + delta: each step's logits are transformers' generate's."""
    folder, model, reference = qwen
    processor = load_image_processor(str(folder))
    files = files_of(PROMPTS[2][1])
    inputs = qwen2_vl_inputs(folder, PROMPTS[2][0], files)
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = reference.generate(
            **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    batch = processor(images=[Image.open(io.BytesIO(f)) for f in files], return_tensors="pt")
    rows = torch.cat(model.encode_images(batch["pixel_values"], batch["image_grid_thw"]))
    positions, delta = model.prompt_rope(len(ids), image_runs(model, processor, ids, files))
    tables, blocks = scattered_tables([len(ids) + NEW_TOKENS])
    cache = new_cache(model, blocks)
    model.image_rows.set(torch.tensor([i for i, t in enumerate(ids) if t == model.image_token_id]), rows)
    model.rope_positions.set(positions)
    logits, _ = step(model, cache, [ids], [0], tables)
    tokens = [int(logits[-1].argmax())]
    for n in range(NEW_TOKENS):
        expected = out.logits[n][0]
        assert torch.allclose(logits[-1], expected, atol=LOGITS_ATOL), (n, (logits[-1] - expected).abs().max())
        if n + 1 == NEW_TOKENS:
            break
        index = len(ids) + n
        model.rope_positions.set(torch.tensor([index + delta]).expand(3, 1))
        logits, _ = step(model, cache, [[tokens[-1]]], [index], tables)
        tokens.append(int(logits[-1].argmax()))
    assert tokens == out.sequences[0, len(ids) :].tolist()


# --- through the shard's engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(qwen):
    return warm_engine(qwen[0])


def prepared(qwen, text: str, sizes):
    """(prompt ids, pb.Image list as the router builds them, transformers' greedy tokens)."""
    folder, model, reference = qwen
    files = files_of(sizes)
    inputs = qwen2_vl_inputs(folder, text, files)
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    runs = image_runs(model, load_image_processor(str(folder)), ids, files)
    images = [
        pb.Image(data=data, digest=hashlib.blake2b(data, digest_size=16).digest(), start=start, length=length)
        for data, (start, length, _) in zip(files, runs, strict=True)
    ]
    return ids, images, out[0, len(ids) :].tolist()


def with_images(batch: pb.Batch, images: list[list[pb.Image]]) -> pb.Batch:
    for request, runs in zip(batch.requests, images, strict=True):
        request.images.extend(runs)
    return batch


def test_the_shard_says_it_takes_images(engine):
    assert engine[1].takes_images


def test_image_and_text_requests_in_one_batch(qwen, engine):
    cases = [prepared(qwen, *p) for p in PROMPTS]
    batch = with_images(make_batch(1, [c[0] for c in cases], 10, NEW_TOKENS), [c[1] for c in cases])
    tokens = run_to_end(engine[0], batch)
    assert [tokens[10 + i] for i in range(3)] == [c[2] for c in cases]


def test_a_prefill_in_chunks_that_end_inside_images(qwen, engine):
    ids, runs, expected = prepared(qwen, *PROMPTS[2])
    batch = with_images(make_batch(2, [ids], 20, NEW_TOKENS, chunk_len=7), [runs])
    assert run_to_end(engine[0], batch)[20] == expected


@pytest.mark.parametrize("cached_blocks", [1, 2])
def test_a_cached_prefix_that_ends_inside_or_after_an_image(qwen, engine, cached_blocks):
    """The first block ends inside the image (its rows after the prefix placed), or two blocks hold all of it (it is
    never encoded; the positions after it still follow its grid)."""
    ids, runs, expected = prepared(qwen, *PROMPTS[0])
    image_end = runs[0].start + runs[0].length
    assert runs[0].start < BLOCK < image_end < 2 * BLOCK < len(ids)
    base = 20 + 10 * cached_blocks  # request (and batch) ids 30, 31 or 40, 41
    first = with_images(make_batch(base, [ids], base, NEW_TOKENS), [runs])
    assert run_to_end(engine[0], first)[base] == expected
    # The same prompt again, its first blocks read from the cache, as the router's prefix cache hands them out.
    again = with_images(make_batch(base + 1, [ids], base + 1, NEW_TOKENS), [runs])
    again.requests[0].blocks[:cached_blocks] = first.requests[0].blocks[:cached_blocks]
    again.requests[0].cache_len = cached_blocks * BLOCK
    assert run_to_end(engine[0], again)[base + 1] == expected


@pytest.mark.skipif(
    not ops.available() or torch.cuda.is_available(), reason="greedy windows run on Kettle's CPU kernels (a CPU shard)"
)
def test_greedy_windows_keep_each_requests_offset(qwen, monkeypatch):
    """Decode calls of several steps in one C loop (an int8 model, whose decode step is fused) give the tokens of
    the same steps one call each, for an image request beside a text one (different offsets)."""
    engine = warm_engine(qwen[0], quantize="int8")[0]
    runner = engine.runner
    windows = []
    greedy = runner.model.greedy_steps
    monkeypatch.setattr(runner.model, "greedy_steps", lambda *a: windows.append(greedy(*a)) or windows[-1])
    cases = [prepared(qwen, *p) for p in PROMPTS[:2]]

    def run(batch_id: int, max_steps: int) -> dict[int, list[int]]:
        batch = with_images(make_batch(batch_id, [c[0] for c in cases], 50, NEW_TOKENS + 4), [c[1] for c in cases])
        tokens: dict[int, list[int]] = {}
        cached = collect(engine.prefill(pb.PrefillRequest(batch=batch)), tokens)
        while cached:
            cached = collect(engine.decode(pb.DecodeRequest(batches=cached, max_steps=max_steps)), tokens)
        return tokens

    single = run(1, 1)
    assert not any(w is not None for w in windows)
    assert run(2, 8) == single
    assert any(w is not None for w in windows)  # the windows ran in C
