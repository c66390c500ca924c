"""Shared by the fallback and seq2seq tests: tiny models Kettle has no native code for."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.fixtures import make_tokenizer

PROMPTS = [
    "Hi",
    "The capital of France is Paris. The capital of",
    "def add(a, b):\n    return a + b\n Large language models generate text",
]


def make_tiny_gpt_neo(path: Path, local_window: int | None = None) -> Path:
    """A 2-layer random GPT-Neo (no native implementation in Kettle); with `local_window`, its second layer
    attends locally (a sliding cache layer: the fallback then runs one request per forward)."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    tokenizer = make_tokenizer(path)
    layers = [[["global"], 2]] if local_window is None else [[["global", "local"], 1]]
    config = GPTNeoConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=layers,
        window_size=local_window or 256,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    GPTNeoForCausalLM(config).eval().save_pretrained(path)
    return path


def make_tiny_t5(path: Path) -> Path:
    """A 2-layer random T5 with the tiny tokenizer; decoding starts from pad, as T5's does."""
    from transformers import T5Config, T5ForConditionalGeneration

    tokenizer = make_tokenizer(path)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than T5's init: greedy outputs vary instead of repeating pad
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.ndim > 1 else param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    return path
