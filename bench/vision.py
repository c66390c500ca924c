"""Vision: one image's encode time and the time to its first token, Kettle in process against transformers.

    .venv/bin/python -m bench vision                       # SmolVLM-256M's shape, random weights, a 512x512 image
    .venv/bin/python -m bench vision --longest-edge 2048   # SmolVLM's own resize: a 4 x 4 grid of tiles + the image
    .venv/bin/python -m bench vision --trials 5 --size 512

No network: the model is built from transformers' Idefics3 config in SmolVLM-256M's shape (a SigLIP-B/16 tower on
512-pixel tiles, pixel shuffle by 4: 64 tokens a tile; a 30-layer Llama of width 576) with random float32 weights
and the tiny test tokenizer, saved to a temporary folder, and loaded by both. Per trial, interleaved:

- encode: the image processor's batch (made once) through the vision tower and connector: Kettle's
  `encode_images` against transformers' `get_image_features`;
- first token: from the image's file to the first token's logits, preprocessing included: Kettle's shard path
  (ImageInputs' processor batch, `encode_images`, a prefill over a fresh paged cache with the image rows, the last
  position's logits) against transformers' processor and one `model(**inputs, logits_to_keep=1)`.

Printed: each side's median seconds and Kettle's same-round ratio to transformers (below 1: Kettle faster).
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

from kettle.bench.timing import interleaved, ratio_summary, same_round


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench vision", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=512, help="the image's side in pixels (default 512)")
    p.add_argument("--longest-edge", type=int, default=512, help="the processor's resize target (SmolVLM: 2048)")
    p.add_argument("--trials", type=int, default=3)
    return p


def build(folder: Path, longest_edge: int) -> None:
    """A random SmolVLM-256M-shaped Idefics3 with the tiny tokenizer and its processor, in `folder`."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from tests.fixtures import make_tokenizer

    tokenizer = make_tokenizer(folder)
    tags = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>", *tags]}
    )
    tokenizer.save_pretrained(folder)
    images = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": 512})
    Idefics3Processor(images, tokenizer, image_seq_len=64).save_pretrained(folder)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
    vision |= dict(image_size=512, patch_size=16)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536)
    text |= dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    text |= dict(tie_word_embeddings=False)
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=4,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)


def vision(argv) -> None:
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from bench.__main__ import command
    from kettle.bench.drive import new_cache, scattered_tables, step
    from kettle.models.registry import load_model
    from kettle.shard.image_inputs import ImageInputs, load_image_processor
    from tests.vision_fixtures import image_bytes

    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, args.longest_edge)
        model = load_model(str(folder), torch.float32, "cpu")
        reference = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        processor = AutoProcessor.from_pretrained(folder)
        images = ImageInputs(model, load_image_processor(str(folder)))
    png = image_bytes("PNG", (args.size, args.size), seed=1)
    text = "<|im_start|>user\n<image>What is in this picture?<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=text, images=[[Image.open(io.BytesIO(png))]], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    features = images.features([png])
    image_token = model.image_token_id

    def kettle_encode():
        return model.encode_images(**features)

    def hf_encode():
        with torch.inference_mode():
            return reference.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])

    def kettle_first_token():
        (rows,) = model.encode_images(**images.features([png]))
        model.image_rows.set(torch.tensor([i for i, t in enumerate(ids) if t == image_token]), rows)
        tables, blocks = scattered_tables([len(ids)])
        logits, _ = step(model, new_cache(model, blocks), [ids], [0], tables)
        return logits[-1].argmax()

    def hf_first_token():
        batch = processor(text=text, images=[[Image.open(io.BytesIO(png))]], return_tensors="pt")
        with torch.inference_mode():
            return reference(**batch, logits_to_keep=1).logits[0, -1].argmax()

    tiles = int((inputs["pixel_values"][0].flatten(1) != 0).any(1).sum())
    print(f"# {command(['vision', *argv])}")
    print(f"# image {args.size}x{args.size}: {tiles} tiles, {ids.count(image_token)} image tokens, prompt {len(ids)}")
    assert int(kettle_first_token()) == int(hf_first_token()), "the two first tokens differ"
    for name, pair in (("encode", (kettle_encode, hf_encode)), ("first token", (kettle_first_token, hf_first_token))):
        kettle, hf = interleaved(pair, args.trials)
        ratio = ratio_summary(same_round(kettle.samples, hf.samples))
        print(f"{name:12s} Kettle {kettle.median:.3f} s  transformers {hf.median:.3f} s  Kettle/transformers {ratio}")
    print(f"# medians of {args.trials} interleaved trials, {torch.get_num_threads()} torch threads")
