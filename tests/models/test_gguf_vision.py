"""Vision-language GGUF pairs natively: a language model's GGUF with its projector file (`mmproj`), as llama.cpp
publishes them, prepared by Kettle into the native family's folder and served against transformers' model of the
same weights (float32): LLaVA (`mlp`, the older converter's layout: truncated layers, fc1/fc2 named the other way
round, an F16 patch kernel), Idefics3/SmolVLM (`idefics3`), Gemma 3 (`gemma3`: a gemma3 language file, the
projector's norm stored as 1 + w, its matrix in F16, the pooling stated), Qwen2-VL (`qwen2vl_merger`) and Qwen2.5-VL
(`qwen2.5vl_merger`: split qkv, the Conv3d kernel split in two frames). For each: the logits of a prompt with an
image beside a text-only one within 1e-4, the shard engine's greedy tokens transformers' own, the router's image
token count the processor's, and the text tensors still read from the language GGUF.
"""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from PIL import Image

from kettle.bench.drive import new_cache, scattered_tables, step
from kettle.hub.gguf import prepare_gguf
from kettle.models.registry import load_model
from kettle.proto import generate_pb2 as pb
from kettle.router.images.tokens import for_model
from kettle.shard.image_inputs import load_image_processor
from tests.mmproj_files import write_pair
from tests.models.family_parity import assert_prompt_logits
from tests.vision_fixtures import (
    image_bytes,
    make_gemma3_folder,
    make_idefics3_folder,
    make_llava_folder,
    make_qwen2_vl_folder,
    qwen2_vl_inputs,
)

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# family → (fixture maker, transformers class, language GGUF architecture, projector type, the prompt's image text)
FAMILIES = {
    "llava": (make_llava_folder, "LlavaForConditionalGeneration", "llama", "mlp", "<image>"),
    "idefics3": (make_idefics3_folder, "Idefics3ForConditionalGeneration", "llama", "idefics3", "<image>"),
    "gemma3": (make_gemma3_folder, "Gemma3ForConditionalGeneration", "gemma3", "gemma3", "<start_of_image>"),
    "qwen2_vl": (make_qwen2_vl_folder, "Qwen2VLForConditionalGeneration", "qwen2vl", "qwen2vl_merger", QWEN_IMAGE),
    "qwen2_5_vl": (
        make_qwen2_vl_folder,
        "Qwen2_5_VLForConditionalGeneration",
        "qwen2vl",
        "qwen2.5vl_merger",
        QWEN_IMAGE,
    ),
}
# Gemma 3's language model as llama.cpp reads a gemma3 file: six layers, the sixth global (the window of 3 shorter
# than the prompts), queries scaled by the head size.
GEMMA3_TEXT = {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
GEMMA3_TEXT |= {"query_pre_attn_scalar": 16}
MAKE_EXTRA = {"gemma3": {"text": GEMMA3_TEXT, "sliding_window": 3}}
SIZES = [(40, 30), (64, 20)]
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(family, the transformers folder, the prepared folder, Kettle's model, transformers' model)."""
    import transformers

    family = request.param
    make, cls, arch, kind, _ = FAMILIES[family]
    root = tmp_path_factory.mktemp(family)
    extra = {"kind": family} if family.startswith("qwen") else MAKE_EXTRA.get(family, {})
    folder = make(root / "hf", weights=True, **extra)
    reference = getattr(transformers, cls).from_pretrained(folder, dtype=torch.float32).eval()
    language, mmproj = write_pair(reference, folder, root / "gguf", arch, kind)
    # The converters' F16 tensors: the older LLaVA converter's patch kernel, Gemma 3's projection matrix.
    rounded = {"llava": "vision_tower.embeddings.patch_embedding.weight"}
    rounded["gemma3"] = "multi_modal_projector.mm_input_projection_weight"
    if family in rounded:
        weight = reference.model.get_parameter(rounded[family])
        with torch.no_grad():
            weight.copy_(weight.half().float())
    prepared = root / "prepared"
    prepared.mkdir()
    prepare_gguf(language, prepared, mmproj=mmproj)
    return family, folder, prepared, load_model(str(prepared), torch.float32, "cpu"), reference


def files_of(sizes) -> list[bytes]:
    return [image_bytes("PNG", size, seed=i) for i, size in enumerate(sizes)]


def reference_inputs(family: str, folder, prepared, text: str, files: list[bytes]) -> dict:
    """What transformers' processor makes of `text` and the images (Qwen's from the prepared folder's image
    processor: its video processor needs torchvision)."""
    from transformers import AutoProcessor

    if family.startswith("qwen"):
        return qwen2_vl_inputs(prepared, text, files)
    images = [Image.open(io.BytesIO(f)) for f in files]
    nested = [images] if family == "idefics3" and images else images
    return dict(AutoProcessor.from_pretrained(folder)(text=text, images=nested or None, return_tensors="pt"))


def prompt(family: str, images: int) -> str:
    marker = FAMILIES[family][4]
    return "<|im_start|>user\n" + marker * images + "What is in the picture?<|im_end|>\n"


def image_runs(prepared, ids: list[int], files: list[bytes], token: int) -> list[pb.Image]:
    """Each image's run as the router sends it: its start (the first image token) and length from the router's own
    count (kettle/router/images/tokens.py)."""
    counter = for_model(prepared)
    where = [i for i, t in enumerate(ids) if t == token]
    runs, at = [], 0
    for data in files:
        length = counter.count(*Image.open(io.BytesIO(data)).size)
        digest = hashlib.blake2b(data, digest_size=16).digest()
        runs.append(pb.Image(data=data, digest=digest, start=where[at], length=length))
        at += length
    assert at == len(where), "the router's count is the processor's"
    return runs


def test_the_prepared_folder_is_the_vision_familys_over_both_files(pair):
    family, _, prepared, model, _ = pair
    assert (prepared / "model.gguf").is_symlink() and (prepared / "mmproj.gguf").is_symlink()
    assert not list(prepared.glob("*.safetensors"))  # the weights stay in the two files
    assert for_model(prepared).model_type == family
    assert type(model).__name__ == FAMILIES[family][1]
    assert model.image_token_id == pair[4].config.image_token_id


def test_logits_match_transformers_with_an_image_beside_text(pair):
    family, folder, prepared, model, reference = pair
    files = files_of(SIZES[:1])
    cases = [(prompt(family, 1), files), ("Hi there", [])]
    all_inputs = [reference_inputs(family, folder, prepared, text, fs) for text, fs in cases]
    chunks = [inputs["input_ids"][0].tolist() for inputs in all_inputs]
    processor = load_image_processor(str(prepared))
    images = [Image.open(io.BytesIO(f)) for f in files]
    batch = processor(images=[images] if family == "idefics3" else images, return_tensors="pt")
    wanted = ("pixel_values", "pixel_attention_mask", "image_grid_thw")
    rows = model.encode_images(**{key: value for key, value in batch.items() if key in wanted})
    rows = torch.cat(list(rows)) if isinstance(rows, list) else rows.reshape(-1, rows.shape[-1])
    token = model.image_token_id
    where = [i for i, t in enumerate(chunks[0]) if t == token]
    assert rows.shape[0] == len(where) == sum(run.length for run in image_runs(prepared, chunks[0], files, token))
    model.image_rows.set(torch.tensor(where), rows)
    if family.startswith("qwen"):
        grid = tuple(batch["image_grid_thw"][0].tolist())
        positions, _ = model.prompt_rope(len(chunks[0]), [(where[0], len(where), grid)])
        plain = torch.arange(len(chunks[1])).expand(3, -1)
        model.rope_positions.set(torch.cat([positions, plain], dim=1))
    tables, blocks = scattered_tables([len(c) for c in chunks])
    logits, _ = step(model, new_cache(model, blocks), chunks, [0, 0], tables)
    assert_prompt_logits(logits, reference, all_inputs, chunks)


def test_the_engine_serves_images_with_transformers_greedy_tokens(pair):
    from tests.models.engine_driver import make_batch, run_to_end, warm_engine

    family, folder, prepared, model, reference = pair
    cases = []
    for count in (1, 2, 0):
        files = files_of(SIZES[:count])
        inputs = reference_inputs(family, folder, prepared, prompt(family, count), files)
        ids = inputs["input_ids"][0].tolist()
        with torch.no_grad():
            out = reference.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        cases.append((ids, image_runs(prepared, ids, files, model.image_token_id), out[0, len(ids) :].tolist()))
    engine = warm_engine(prepared)[0]
    batch = make_batch(1, [ids for ids, _, _ in cases], 10, NEW_TOKENS)
    for request, (_, runs, _) in zip(batch.requests, cases, strict=True):
        request.images.extend(runs)
    tokens = run_to_end(engine, batch)
    assert [tokens[10 + i] for i in range(len(cases))] == [expected for _, _, expected in cases]
