"""Incremental detokenization, byte-level BPE and sentencepiece-style (Metaspace + byte fallback) tokenizers."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kettle.shard.detokenize import IncrementalDetokenizer, is_special, special_token_ids
from tests.fixtures import CORPUS

# Characters outside CORPUS ("猫咪", "🦀", the ZWJ sequence) come out as single bytes, split over tokens.
TEXTS = {
    "english": "The capital of France is Paris. How are you today?",
    "chinese": "你好，世界！猫咪喜欢吃鱼。",
    "emoji": "Party 🎉🦀 then 🧑‍🚀 and 👍🏽!",
}
PROMPT = "Hello world! "


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style BPE: Metaspace pre-tokenizer, <0xNN> byte-fallback tokens, leading space stripped on decode."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # The trainer has no byte-fallback option: add the 256 byte tokens to the trained vocabulary.
    spec = json.loads(tok.to_str())
    for byte in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, prompt_ids: list[int], generated: list[int]) -> tuple[IncrementalDetokenizer, list[str]]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    return detokenizer, [detokenizer.step(token) for token in generated]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("language", TEXTS)
def test_byte_level_pieces_concatenate_to_the_decode(tiny_tokenizer, language):
    generated = encode(tiny_tokenizer, TEXTS[language])
    detokenizer, pieces = stream(tiny_tokenizer, encode(tiny_tokenizer, PROMPT), generated)
    assert "".join(pieces) == tiny_tokenizer.decode(generated, skip_special_tokens=False) == TEXTS[language]
    assert not any("\ufffd" in piece for piece in pieces)
    assert detokenizer.text() == TEXTS[language]


def test_incomplete_characters_are_held_back(tiny_tokenizer):
    generated = encode(tiny_tokenizer, "🦀")
    assert len(generated) > 1  # the crab is split over byte tokens
    _, pieces = stream(tiny_tokenizer, [], generated)
    assert pieces == [""] * (len(generated) - 1) + ["🦀"]


@pytest.mark.parametrize("language", TEXTS)
def test_sentencepiece_pieces_follow_the_prompt(sentencepiece_tokenizer, language):
    tokenizer = sentencepiece_tokenizer
    prompt, generated = encode(tokenizer, PROMPT), encode(tokenizer, TEXTS[language])
    detokenizer, pieces = stream(tokenizer, prompt, generated)
    # In context the first "▁word" keeps its space, which a stand-alone decode strips.
    in_context = tokenizer.decode(prompt + generated)[len(tokenizer.decode(prompt)) :]
    assert "".join(pieces) == in_context == " " + TEXTS[language]
    assert not any("\ufffd" in piece for piece in pieces)
    assert detokenizer.text() == in_context


@pytest.mark.parametrize("language", TEXTS)
def test_sentencepiece_without_prompt_matches_the_plain_decode(sentencepiece_tokenizer, language):
    generated = encode(sentencepiece_tokenizer, TEXTS[language])
    assert any(token.startswith("<0x") for token in sentencepiece_tokenizer.convert_ids_to_tokens(generated)) == (
        language != "english"
    )
    _, pieces = stream(sentencepiece_tokenizer, [], generated)
    assert "".join(pieces) == sentencepiece_tokenizer.decode(generated) == TEXTS[language]
    assert not any("\ufffd" in piece for piece in pieces)


def test_short_prompt_context(sentencepiece_tokenizer):
    prompt = encode(sentencepiece_tokenizer, "Hi")
    generated = encode(sentencepiece_tokenizer, "Hello world")
    _, pieces = stream(sentencepiece_tokenizer, prompt, generated)
    assert "".join(pieces) == " Hello world"


def test_special_tokens_stream_as_text_and_are_skipped_in_text(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    generated = [*encode(tiny_tokenizer, "Paris."), eos]
    detokenizer, pieces = stream(tiny_tokenizer, encode(tiny_tokenizer, PROMPT), generated)
    assert pieces[-1] == "<|endoftext|>"
    assert detokenizer.text() == "Paris."
    assert detokenizer.text(skip_special_tokens=False) == "Paris.<|endoftext|>"


def test_special_token_ids(tiny_tokenizer):
    specials = {tiny_tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert special_token_ids(tiny_tokenizer) == specials
    assert is_special(tiny_tokenizer, tiny_tokenizer.eos_token_id)
    assert not is_special(tiny_tokenizer, encode(tiny_tokenizer, "Paris")[0])


# Ids as raw byte strings: token 2 ends 我 and begins 天 (byte-level merges cross character boundaries).
BYTE_VOCAB = {0: b"A", 1: "我".encode()[:2], 2: "我".encode()[2:] + "天".encode()[:1], 3: "天".encode()[1:]}


class ByteTokenizer:
    """BYTE_VOCAB's ids decoded as UTF-8 with replacement, as a byte-level tokenizer decodes."""

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return b"".join(BYTE_VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def test_a_token_that_completes_one_character_and_begins_another_is_flushed_at_the_end():
    """Token 2 ends 我 and begins 天: `step` holds both back; a generation ending there flushes 我 (and only
    that), so the stream's pieces match the final text less its incomplete tail."""
    detokenizer, pieces = stream(ByteTokenizer(), [], [0, 1, 2])
    assert pieces == ["A", "", ""]
    assert detokenizer.flush() == "我"
    assert detokenizer.text() == "A我\ufffd"
    detokenizer, pieces = stream(ByteTokenizer(), [], [0, 1, 2, 3])
    assert pieces == ["A", "", "", "我天"] and detokenizer.flush() == ""
