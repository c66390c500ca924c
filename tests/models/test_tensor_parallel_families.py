"""Tensor parallelism of every native family: logits of 2 gloo ranks (two spawned processes) against one shard.

Each case is a tiny random checkpoint of one family (2 layers, hidden 64, 4 heads, 2 KV heads where the family
groups them). Both ranks load it with `load_model` under a world of 2, so each reads only its slice, and run
a batched prefill of three prompts and one decode step over their own paged KV cache; one unsharded load runs
the same steps. The logits must agree within 1e-4 in float32 (the sums are only reordered), on both ranks.
Int8 cases (Phi-3, StarCoder2) compare 2 quantized ranks with one quantized shard: column-parallel slices
keep their per-channel scales, but row-parallel slices get the scales of their own columns, so the logits
differ by about as much as int8 differs from float32 (a few percent of their range), not 1e-4.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kettle.bench.process import free_port
from tests.models.family_parity import save_tiny, tiny_settings
from tests.models.test_gemma3 import make_gemma3_text
from tests.models.test_gpt_families import build, gpt2_names
from tests.vision_fixtures import make_gemma3_folder, make_idefics3_folder, make_llava_folder, make_qwen2_vl_folder

# gloo on the CPU: with CUDA the shards would run NCCL, which needs a GPU per rank.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) tensor-parallel test")
WORLD = 2
PROMPTS = [[5, 17, 99, 3, 250], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
ATOL = 1e-4
INT8_RTOL = 0.05  # of the logits' largest magnitude (measured: 2%; int8 against float32 is 2-5% here)


def _transformers(name: str, **settings):
    """A builder saving transformers' `{name}ForCausalLM` with the tiny shape plus `settings`."""

    def make(path: Path) -> None:
        import transformers

        config = getattr(transformers, f"{name}Config")(**(tiny_settings(path) | settings))
        save_tiny(path, config, getattr(transformers, f"{name}ForCausalLM"))

    return make


def _gptj(path: Path) -> None:
    from transformers import GPTJConfig, GPTJForCausalLM

    save_tiny(path, GPTJConfig(**gpt2_names(tiny_settings(path)), rotary_dim=8), GPTJForCausalLM)


def _gpt_neox(path: Path) -> None:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    settings = {k: v for k, v in tiny_settings(path).items() if k != "num_key_value_heads"}
    save_tiny(path, GPTNeoXConfig(**settings, bos_token_id=settings["eos_token_id"]), GPTNeoXForCausalLM)


def _gpt_case(case: str):
    """A case of tests/models/test_gpt_families.py."""
    return lambda path: build(path, case)


# Case → builder. "(int8)" cases load both sides with --quantize int8.
CASES = {
    "phi3": _transformers("Phi3", pad_token_id=0, sliding_window=8),
    "starcoder2": _transformers("Starcoder2", pad_token_id=0),
    "mixtral": _transformers("Mixtral", num_local_experts=4, num_experts_per_tok=2),
    "gemma2": _gpt_case("gemma2"),
    "gemma3_text": make_gemma3_text,
    "gpt_neox": _gpt_neox,
    "gptj": _gptj,
    "phi": _transformers("Phi", num_key_value_heads=4, qk_layernorm=True),
    "falcon": _gpt_case("falcon"),
    "falcon (40b layout)": _gpt_case("falcon (40b layout)"),
    "falcon (alibi)": _gpt_case("falcon (alibi)"),
    "gpt2": _gpt_case("gpt2"),
    "gpt_bigcode (multi-head)": _gpt_case("gpt_bigcode (multi-head)"),
    "opt": _gpt_case("opt"),
    "opt (350m layout)": _gpt_case("opt (350m layout)"),
    "bloom (6 heads)": _gpt_case("bloom (6 heads)"),
    "mpt (clip_qkv)": _gpt_case("mpt (clip_qkv)"),
    # Vision-language models: the language model sliced, the tower and projector whole on each rank.
    "llava": lambda path: make_llava_folder(path, weights=True),
    "idefics3": lambda path: make_idefics3_folder(path, weights=True),
    "qwen2_vl": lambda path: make_qwen2_vl_folder(path, weights=True),
    "qwen2_5_vl": lambda path: make_qwen2_vl_folder(path, weights=True, kind="qwen2_5_vl"),
    "gemma3": lambda path: make_gemma3_folder(path, weights=True),  # its image's 4 tokens attended both ways
}
INT8_CASES = ["phi3", "starcoder2"]


def _logits(path: str, quantize: str | None) -> dict:
    """Logits of a batched prefill of PROMPTS, then of one decode step of every prompt (this process's load),
    and how many of the model's projections are int8."""
    from kettle.bench.drive import new_cache, scattered_tables, step
    from kettle.models.registry import load_model
    from kettle.quantization.int8 import Int8Linear

    model = load_model(path, torch.float32, "cpu", quantize=quantize)
    tables, num_blocks = scattered_tables([len(p) + 1 for p in PROMPTS])
    cache = new_cache(model, num_blocks)
    prefill, _ = step(model, cache, PROMPTS, [0] * len(PROMPTS), tables)
    # Fixed next tokens (not each load's argmax), so the decode steps compare even where int8 picks differ.
    decode, _ = step(model, cache, [[1], [2], [3]], [len(p) for p in PROMPTS], tables)
    int8 = sum(isinstance(m, Int8Linear) for m in model.modules())
    result = {"prefill": prefill, "decode": decode, "int8 layers": int8, "heads": model.spec.num_heads}
    if hasattr(model, "encode_images"):  # a vision-language model: a prompt with one image too
        result["image prefill"] = _image_logits(model)
    return result


def _image_logits(model) -> torch.Tensor:
    """Logits of a prompt holding one fixed random 32x32 image (one tile for Idefics3), each rank encoding it;
    Qwen2-VL's as its 8 x 8 patches of 4 x 4 pixels (two frames), at its M-RoPE positions."""
    from kettle.bench.drive import new_cache, scattered_tables, step

    nested, seeded = getattr(model, "image_batches_nested", False), torch.Generator().manual_seed(0)
    if hasattr(model, "rope_positions"):
        grid = torch.tensor([[1, 8, 8]])
        (rows,) = model.encode_images(torch.randn((64, 3 * 2 * 4 * 4), generator=seeded), grid)
    else:
        (rows,) = model.encode_images(torch.randn((1, 1, 3, 32, 32) if nested else (1, 3, 32, 32), generator=seeded))
    prompt = [5, 17, *[model.image_token_id] * rows.shape[0], 3]
    model.image_rows.set(torch.arange(2, 2 + rows.shape[0]), rows)
    if hasattr(model, "rope_positions"):
        model.rope_positions.set(model.prompt_rope(len(prompt), [(2, rows.shape[0], (1, 8, 8))])[0])
    tables, num_blocks = scattered_tables([len(prompt)])
    logits, _ = step(model, new_cache(model, num_blocks), [prompt], [0], tables)
    return logits


def _runs(models: dict[str, str]) -> dict[str, dict]:
    return {name: _logits(path, "int8" if name.endswith("(int8)") else None) for name, path in models.items()}


def _worker(rank: int, models: dict[str, str], port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    from kettle.tensors import distributed

    distributed.init_distributed(rank, WORLD, torch.device("cpu"))
    try:
        result = _runs(models)
    finally:
        distributed.shutdown()
    torch.save(result, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def logits(tmp_path_factory):
    """(each rank's logits per case, one shard's logits per case)."""
    models = {}
    for name, make in CASES.items():
        path = tmp_path_factory.mktemp("tp-family")
        make(path)
        models[name] = str(path)
    models |= {f"{name} (int8)": models[name] for name in INT8_CASES}
    out = tmp_path_factory.mktemp("tp-family-out")
    mp.spawn(_worker, args=(models, free_port(), str(out)), nprocs=WORLD, join=True)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    return ranks, _runs(models)


@pytest.mark.parametrize("case", [*CASES, *(f"{name} (int8)" for name in INT8_CASES)])
def test_two_ranks_give_the_logits_of_one_shard(logits, case):
    ranks, single = logits
    int8 = case.endswith("(int8)")
    # Each rank ran its share of the heads (2 of the 4 here; 3 of BLOOM's 6).
    assert sum(result[case]["heads"] for result in ranks) == single[case]["heads"]
    for rank, result in enumerate(ranks):
        # Every projection of a rank is quantized, as on one shard, its block of the LM head included.
        assert result[case]["int8 layers"] == single[case]["int8 layers"], f"rank {rank}"
        for step in ("prefill", "decode", "image prefill"):
            if step not in single[case]:
                continue
            got, want = result[case][step], single[case][step]
            atol = INT8_RTOL * float(want.abs().max()) if int8 else ATOL
            where = f"rank {rank} {step}"
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m, where=where: f"{where}: {m}")
