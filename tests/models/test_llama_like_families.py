"""Kettle's RoPE families beyond Llama against transformers: Mixtral, Qwen3, Gemma, Phi, Phi-3, GPT-J,
GPT-NeoX and StarCoder2, each a tiny random checkpoint built from its transformers config class.

Each case runs the shared parity check (`assert_parity`: batched paged logits within 1e-4 of transformers in
float32, greedy generation of three prompts in one batch token-identical). Shapes: 2 layers, hidden 64,
4 heads (2 KV heads where the family has grouped-query attention), the tiny tokenizer's vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.family_parity import assert_parity, save_tiny, tiny_settings
from tests.models.test_gpt_families import gpt2_names


def llama_names(settings: dict, **extra) -> dict:
    """The tiny shape as Llama-style configs name it (`tiny_settings`), with the family's own settings on top."""
    return settings | extra


def assert_chunked_prefill_matches(path) -> None:
    """Prefilling in two chunks (the second over the cached first) gives the one-shot prefill's logits."""
    from kettle.bench.drive import new_cache, scattered_tables, step
    from kettle.models.registry import load_model

    model, prompt = load_model(str(path), torch.float32, "cpu"), list(range(3, 43))
    tables, num_blocks = scattered_tables([len(prompt)])
    whole, _ = step(model, new_cache(model, num_blocks), [prompt], [0], tables)
    cache, split = new_cache(model, num_blocks), 9
    step(model, cache, [prompt[:split]], [0], tables)
    rest, _ = step(model, cache, [prompt[split:]], [split], tables)
    torch.testing.assert_close(rest, whole[split:], atol=1e-5, rtol=0)


def test_mixtral_parity(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**llama_names(tiny_settings(tmp_path), num_local_experts=4, num_experts_per_tok=2))
    assert_parity(save_tiny(tmp_path, config, MixtralForCausalLM), "mixtral")
    _check_fused_expert_names(tmp_path, config.num_local_experts)


def _check_fused_expert_names(path, num_experts: int) -> None:
    """The same Mixtral with transformers v5's fused 3-D expert tensors loads to the same logits."""
    from safetensors.torch import load_file, save_file

    from kettle.bench.drive import new_cache, scattered_tables, step
    from kettle.models.registry import load_model

    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("block_sparse_moe.gate.weight")]:
        layer = name.removesuffix(".block_sparse_moe.gate.weight")
        expert = [f"{layer}.block_sparse_moe.experts.{e}" for e in range(num_experts)]
        w1, w2, w3 = ([tensors.pop(f"{x}.{w}.weight") for x in expert] for w in ("w1", "w2", "w3"))
        tensors[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(p) for p in zip(w1, w3, strict=True)])
        tensors[f"{layer}.mlp.experts.down_proj"] = torch.stack(w2)
        tensors[f"{layer}.mlp.gate.weight"] = tensors.pop(name)
    legacy = load_model(str(path), torch.float32, "cpu")
    save_file(tensors, path / "model.safetensors")
    fused = load_model(str(path), torch.float32, "cpu")
    tables, num_blocks = scattered_tables([5])
    logits = [step(m, new_cache(m, num_blocks), [[5, 6, 7, 8, 9]], [0], tables)[0] for m in (legacy, fused)]
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
    # The graph-capture path (every expert, zero weights off the top-k) sums to the grouped path's result.
    moe, x = fused.layers[0].mlp, torch.randn(7, fused.spec.hidden_size)
    experts, weights = moe.route(x)
    torch.testing.assert_close(moe._dense(x, experts, weights), moe._grouped(x, experts, weights), atol=1e-5, rtol=0)


def test_qwen3_parity(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**llama_names(tiny_settings(tmp_path), head_dim=16, tie_word_embeddings=False))
    assert_parity(save_tiny(tmp_path, config, Qwen3ForCausalLM), "qwen3")


def test_gemma_parity(tmp_path):
    from transformers import GemmaConfig, GemmaForCausalLM

    # head_dim 32 ≠ hidden / heads, as in Gemma 7B (256 × 16 heads > 3072).
    config = GemmaConfig(**llama_names(tiny_settings(tmp_path), head_dim=32, pad_token_id=0))
    assert_parity(save_tiny(tmp_path, config, GemmaForCausalLM), "gemma")


PHI3_VARIANTS = {
    "phi3": {},
    "phi3_sliding": {"sliding_window": 8},
    # Longrope with a trained length of 24: prompts 1 and 2 (up to 21 tokens with the generated ones) use the
    # short factors, prompt 3 (27 tokens and more) the long ones, in the same batch; with a partial rotary
    # (half of each head), as Phi-4 mini has. No prompt crosses 24 while generating: there transformers'
    # generate recomputes the whole sequence with the long factors, while Kettle (like TGI) keeps the cache.
    "phi3_longrope": {
        "original_max_position_embeddings": 24,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.1, 1.3, 1.6],
            "long_factor": [1.0, 2.0, 4.0, 8.0],
        },
    },
}


@pytest.mark.parametrize("variant", list(PHI3_VARIANTS))
def test_phi3_parity(tmp_path, variant):
    from transformers import Phi3Config, Phi3ForCausalLM

    settings = llama_names(tiny_settings(tmp_path), pad_token_id=0, **PHI3_VARIANTS[variant])
    assert_parity(save_tiny(tmp_path, Phi3Config(**settings), Phi3ForCausalLM), variant)
    if variant == "phi3_sliding":  # chunks that reach past the window; (longrope chunks would cross its length)
        assert_chunked_prefill_matches(tmp_path)


def test_starcoder2_parity(tmp_path):
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    config = Starcoder2Config(**llama_names(tiny_settings(tmp_path), sliding_window=8, pad_token_id=0))
    assert_parity(save_tiny(tmp_path, config, Starcoder2ForCausalLM), "starcoder2")


@pytest.mark.parametrize("qk_layernorm", [False, True], ids=["plain", "qk_layernorm"])
def test_phi_parity(tmp_path, qk_layernorm):
    from transformers import PhiConfig, PhiForCausalLM

    # Multi-head, like Phi-1/1.5/2; the partial rotary factor stays transformers' default (0.5).
    settings = llama_names(tiny_settings(tmp_path), num_key_value_heads=4, qk_layernorm=qk_layernorm)
    family = "phi_qk_layernorm" if qk_layernorm else "phi"
    assert_parity(save_tiny(tmp_path, PhiConfig(**settings), PhiForCausalLM), family)


def test_gptj_parity(tmp_path):
    from transformers import GPTJConfig, GPTJForCausalLM

    # Half of each 16-wide head rotated, interleaved pairs.
    config = GPTJConfig(**gpt2_names(tiny_settings(tmp_path)), rotary_dim=8)
    assert_parity(save_tiny(tmp_path, config, GPTJForCausalLM), "gptj")
    assert_chunked_prefill_matches(tmp_path)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_gpt_neox_parity(tmp_path, parallel):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    settings = {k: v for k, v in tiny_settings(tmp_path).items() if k != "num_key_value_heads"}
    config = GPTNeoXConfig(**settings, use_parallel_residual=parallel, bos_token_id=settings["eos_token_id"])
    family = "gpt_neox" if parallel else "gpt_neox_sequential"
    assert_parity(save_tiny(tmp_path, config, GPTNeoXForCausalLM), family)
    assert_chunked_prefill_matches(tmp_path)
