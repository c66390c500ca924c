"""Tiny random-weight models and a tiny byte-level BPE tokenizer, built at test time (no downloads)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Enough text for a byte-level BPE that covers English words, Chinese and emoji.
CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Large language models generate text one token at a time.",
    "你好，世界！今天天气很好。我们一起去公园吧。",
    "Emoji: 😀 😃 🎉 🚀 ❤️ 👍🏽 and more text after them.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000",
] * 20

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen and SmolLM write it: one `<|im_start|>role\n...<|im_end|>\n` block per message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def kernels_buildable() -> bool:
    """Whether Kettle's CPU kernels build here (gcc, an AVX2/FMA/F16C CPU) and are not switched off for the run
    (`KETTLE_TUNING=cpu-kernels=off`, e.g. on a GPU machine): tests that call them directly skip otherwise."""
    import os
    import shutil

    from kettle.kernels import build, isa
    from kettle.settings import Settings

    switched_off = not Settings.from_env(os.environ).cpu_kernels
    return not switched_off and shutil.which("gcc") is not None and set(build.REQUIRED_CPU_FLAGS) <= isa.cpu_flags()


def make_tokenizer(path: Path, vocab_size: int = 512, chat_template: str | None = CHATML_TEMPLATE):
    """Trains a byte-level BPE tokenizer on CORPUS and saves it (HF fast tokenizer format) into `path`,
    with `chat_template` (ChatML by default; None saves no template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=256,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return fast


def tiny_config(tokenizer) -> dict:
    """The shape every tiny test model shares: 2 layers, hidden 64, grouped-query attention."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        # Large weights give peaked logits, so greedy choices are not decided by rounding noise.
        initializer_range=0.2,
    )


def make_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Saves a 2-layer random LlamaForCausalLM (safetensors) with the tiny tokenizer into `path`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer(path)
    settings = tiny_config(tokenizer) | dict(
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False
    )
    settings.update(overrides)
    config = LlamaConfig(**settings)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(path)
    (path / "kettle_test_model.json").write_text(json.dumps({"seed": seed}))
    return path


def make_variant(path: Path, variant: str) -> Path:
    """A tiny checkpoint of `variant`: llama, tied, llama3_rope, dynamic_rope, qwen2 or mistral_sliding."""
    overrides = {
        "llama": {},
        "tied": {"tie_word_embeddings": True},
        "llama3_rope": {"rope_parameters": _rope("llama3", low_freq_factor=1.0, high_freq_factor=4.0)},
        # A short trained length, so prompts plus generations run past it and the base grows.
        "dynamic_rope": {"max_position_embeddings": 24, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
    }
    if variant in overrides:
        return make_tiny_llama(path, **overrides[variant])
    return _make_other(path, variant)


def _rope(rope_type: str, **extra) -> dict:
    return {
        "rope_type": rope_type,
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
    } | extra


def _make_other(path: Path, variant: str) -> Path:
    """Qwen2 (q/k/v biases, tied) and Mistral (sliding window of 8) through their own transformers classes."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = make_tokenizer(path)
    common = tiny_config(tokenizer)
    if variant == "qwen2":
        config, cls = Qwen2Config(tie_word_embeddings=True, **common), Qwen2ForCausalLM
    elif variant == "mistral_sliding":
        config, cls = MistralConfig(sliding_window=8, tie_word_embeddings=False, **common), MistralForCausalLM
    else:
        raise ValueError(f"unknown test variant {variant!r}")
    torch.manual_seed(0)
    model = cls(config).eval()
    # Biases are zero-initialised; random ones make sure they are actually loaded and applied.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@contextmanager
def cpu_kernels(on: bool) -> Iterator[None]:
    """Kettle's CPU kernels on or off inside the block (`KETTLE_TUNING`'s `cpu-kernels`, the variable's other
    items kept), as they were after it. Off is the path of machines without gcc or AVX2: every op falls back to
    PyTorch's."""
    import os

    from kettle import settings
    from kettle.kernels import build

    def forget() -> None:
        build.library.cache_clear()
        # Outside a test function (a module fixture) settings are still the cached ones: read them again.
        getattr(settings.current, "cache_clear", lambda: None)()

    before = os.environ.get(settings.TUNING_VARIABLE)
    os.environ[settings.TUNING_VARIABLE] = settings.merge_tuning(before, {"cpu-kernels": on})
    forget()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(settings.TUNING_VARIABLE)
        else:
            os.environ[settings.TUNING_VARIABLE] = before
        forget()


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch (and Kettle's CPU kernels) with `count` threads inside the block, the previous count after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tune(monkeypatch, *items: str) -> None:
    """Sets `KETTLE_TUNING` to the non-empty `items` for the test (none: the defaults); tests/conftest.py makes the
    settings follow the environment, so the kernels' path chooser and every other reader see it at once."""
    monkeypatch.setenv("KETTLE_TUNING", ",".join(item for item in items if item))


def add_tuning(monkeypatch, **items: object) -> None:
    """Sets the `KETTLE_TUNING` keys `items` (underscores for dashes; a bool as on/off) beside those already set, as
    fixtures that each pick one switch do."""
    import os

    from kettle.settings import merge_tuning

    items = {key.replace("_", "-"): value for key, value in items.items()}
    monkeypatch.setenv("KETTLE_TUNING", merge_tuning(os.environ.get("KETTLE_TUNING"), items))


@contextmanager
def kernel_switch(symbol: str, value: int) -> Iterator[None]:
    """One of the kernels' measurement switches (a C int: `kettle_integer_lanes8`, `kettle_channel_one`) set to
    `value` inside the block, its own value restored after."""
    import ctypes

    from kettle.kernels import build

    switch = ctypes.c_int.in_dll(build.library(), symbol)
    before, switch.value = switch.value, value
    try:
        yield
    finally:
        switch.value = before


@contextmanager
def cpu_isa(choice: str) -> Iterator[None]:
    """The loaded library limited to `choice` (kettle/kernels/isa.py, what `KETTLE_TUNING=cpu-isa` does at load)
    inside the block, every switch it sets restored after."""
    import ctypes

    from kettle.kernels import build, isa

    lib = build.library()
    names = ("kettle_cpu_vnni512", "kettle_avx2_vnni", *isa.AVX512_SWITCHES)
    before = {name: ctypes.c_int.in_dll(lib, name).value for name in names}
    try:
        isa.restrict(lib, choice)
        yield
    finally:
        for name, value in before.items():
            ctypes.c_int.in_dll(lib, name).value = value


@contextmanager
def vector_width(symbol: str, avx512: bool) -> Iterator[None]:
    """One of the kernels' vector-width choices (`kettle_gemm_avx512`, `kettle_attention_avx512`: -1 picks by the
    CPU) forced to AVX-512 or AVX2 inside the block; skips the test where AVX-512 is asked for and missing."""
    import ctypes

    import pytest

    from kettle import settings
    from kettle.kernels import build, isa

    if avx512 and "avx512f" not in isa.cpu_flags() and not settings.current().emulate_avx512:
        pytest.skip("no AVX-512 here")
    choice = ctypes.c_int.in_dll(build.library(), symbol)
    choice.value = int(avx512)
    try:
        yield
    finally:
        choice.value = -1


def vma_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address` (Linux)."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields
