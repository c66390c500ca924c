"""The bundled model's tokenizer as the shard now reads it (tokenizer.json through the `tokenizers` library, no
transformers): every streamed piece, final text and token text equals what transformers' tokenizer gives."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from kettle.hub.resolve import resolve_model
from kettle.shard.detokenize import IncrementalDetokenizer
from kettle.shard.vocab import FileTokenizer, Vocab

TEXTS = [
    "The capital of France is Paris. How are you today?",
    "def f(x):\n\treturn  x ** 2   # squares\n\n\n",
    "你好，世界！猫咪喜欢吃鱼。日本語のテキストも。",
    "Party 🎉🦀 then 🧑‍🚀 and 👍🏽! Flags: 🇫🇷🇯🇵",
    "Crème brûlée, naïve façade, Ångström, ß, İstanbul",
    "مرحبا بالعالم — Привет, мир — שלום",
    "∀x ∈ ℝ: x² ≥ 0 ⇒ √(x²) = |x|  ½ ¾ ∞",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  ",
]


@pytest.fixture(scope="module")
def tokenizers():
    path = resolve_model(None).path
    vocab = Vocab.load(str(path))
    assert isinstance(vocab.tokenizer, FileTokenizer)
    return vocab, AutoTokenizer.from_pretrained(path)


def stream(tokenizer, prompt: list[int], generated: list[int]) -> tuple[list[str], str, str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.step(token) for token in generated]
    return pieces, detokenizer.text(skip_special_tokens=True), detokenizer.text(skip_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_transformers(tokenizers, text):
    vocab, reference = tokenizers
    prompt = reference.encode("Say something: ", add_special_tokens=False)
    generated = reference.encode(text, add_special_tokens=False)
    ours = stream(vocab.tokenizer, prompt, generated)
    assert ours == stream(reference, prompt, generated)
    assert "".join(ours[0]) == reference.decode(generated, clean_up_tokenization_spaces=False) == text


@pytest.mark.parametrize("seed", range(5))
def test_random_token_sequences_decode_as_transformers(tokenizers, seed):
    """Arbitrary ids, special tokens and partial UTF-8 byte tokens included."""
    vocab, reference = tokenizers
    rng = random.Random(seed)
    prompt = [rng.randrange(len(reference)) for _ in range(8)]
    generated = [rng.randrange(len(reference)) if rng.random() < 0.9 else rng.randrange(17) for _ in range(300)]
    assert stream(vocab.tokenizer, prompt, generated) == stream(reference, prompt, generated)


def test_token_texts_and_special_flags_equal_transformers(tokenizers):
    vocab, reference = tokenizers
    twin = Vocab(reference, vocab.eos_token_ids)
    ids = range(len(reference))
    assert [vocab.token_text(i) for i in ids] == [twin.token_text(i) for i in ids]
    assert vocab.special_ids == twin.special_ids
    assert vocab.tokenizer.eos_token_id == reference.eos_token_id
