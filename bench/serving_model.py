"""The serving benchmark's model: a random-weight Llama checkpoint (tiny, or Llama-3.1-8B's shape) whose answers
always run to the length a request asks for, with a word-level tokenizer that makes a prompt of N words N tokens.

Forced lengths. TGI's API has no `ignore_eos`, and a random model may pick its end-of-sequence token at any step.
So the checkpoint's LM head has a zero row for EOS while every other row is random: EOS's logit is exactly 0 at
every step, and greedy decoding picks it only if all other logits are negative at once, which for random rows
(each as likely positive as negative) has a chance of 2^-(vocab - 1). Quantization keeps the row zero (a row's
scale is clamped above zero, and zero quantizes to zero). The benchmark still counts every answer's tokens and
reports any that came out short.

Exact prompt lengths. The tokenizer is word level: token i is the word `w{i}` (ids 0-2 are `<pad>`, `<s>`,
`</s>`), with no BOS added, so the prompt "w17 w230 ..." of N words is N tokens for the server and for
transformers alike, and its vocabulary is the model's whole embedding table (no id the model can pick is unknown
to the detokenizer).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<s>", "</s>")
SEED = 0
# Bump when what is written changes, so a cached checkpoint of an older layout is not reused.
LAYOUT = 1

SHAPES = {
    # As tests/fixtures.py's tiny Llama: 2 layers, hidden 64, grouped-query attention; large weights give peaked
    # logits, as there. Positions for the whole mix (1,500 + 800 tokens) unscaled.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
    ),
    # meta-llama/Llama-3.1-8B's config.json: its shape, RoPE and norms (the tokenizer is ours, same vocab size).
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def word(token: int) -> str:
    return SPECIALS[token] if token < len(SPECIALS) else f"w{token}"


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[PAD]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=SPECIALS[PAD],
        bos_token=SPECIALS[BOS],
        eos_token=SPECIALS[EOS],
        model_max_length=SHAPES["llama-3.1-8b"]["max_position_embeddings"],
    )
    fast.save_pretrained(folder)


def build(folder: Path, shape: str, device: str, dtype: str) -> Path:
    """Writes the checkpoint of `shape` into `folder` (safetensors, `dtype`), its weights drawn on `device`; a
    folder already complete (same shape, dtype and layout) is reused: an 8B checkpoint takes minutes to write."""
    marker = folder / "kettle_serving_model.json"
    stamp = {"shape": shape, "dtype": dtype, "seed": SEED, "layout": LAYOUT}
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return folder
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, SHAPES[shape]["vocab_size"])
    config = LlamaConfig(
        **SHAPES[shape], bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False
    )
    torch.manual_seed(SEED)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        model.lm_head.weight[EOS].zero_()
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the server about to start sizes its KV cache from the GPU's free memory
    marker.write_text(json.dumps(stamp))
    return folder


def prompt_ids(key: str, tokens: int, vocab_size: int) -> list[int]:
    """The prompt of the request named `key` (its workload and index): `tokens` ordinary words drawn from a
    generator seeded by the key, so every request has a prompt of its own (no prefix-cache hit between requests
    or between workloads) and every run the same ones."""
    rng = random.Random(key)
    return [rng.randrange(len(SPECIALS), vocab_size) for _ in range(tokens)]


def prompt_text(ids: list[int]) -> str:
    return " ".join(word(i) for i in ids)
