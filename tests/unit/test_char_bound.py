"""The fewest tokens a text can have from its length (kettle/router/char_bound.py): a true lower bound on real
tokenizers, none for the pipelines that can fold any number of characters into one token, and the tail of a
long prompt giving exactly the whole prompt's last tokens."""

from __future__ import annotations

import random
import unicodedata

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kettle.router.char_bound import (
    LLAMA3_WORDS,
    MAX_COMPOSED,
    QWEN2_WORDS,
    CharBound,
    byte_level_chars,
    char_bound,
    normalizer_shrink,
)
from kettle.router.tokenizer import LONG_TEXT_CHARS, RustTokenizer, _encode, load_tokenizer
from tests.fixtures import CORPUS, make_tokenizer

# Text a prompt may hold: words, runs of spaces and newlines, CJK, emoji, combining marks, control characters.
PIECES = [
    "the",
    "kettle",
    "boils",
    " ",
    "   ",
    "\n",
    "\n\n  ",
    "你好",
    "世界",
    "😀",
    "👍🏽",
    "e\u0301",
    "ᾂ",
    "\x04",
    "\x13",
]
PIECES += ["Paris.", "123", "4567", "'s", "<|im_start|>", "\t", "!!", "=" * 30, "a" * 50]


def random_text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(PIECES) + rng.choice(["", " "]) for _ in range(pieces))


def trained(pre_tokenizer, normalizer=None, **bpe) -> Tokenizer:
    """A small BPE trained on the test corpus with the given pipeline (byte-level unless told otherwise)."""
    tokenizer = Tokenizer(models.BPE(**bpe))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_start|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tiny(folder) -> RustTokenizer:
    tokenizer = load_tokenizer(str(folder))
    assert isinstance(tokenizer, RustTokenizer)
    return tokenizer


def llama3_like() -> Tokenizer:
    split = pre_tokenizers.Split(pattern=_regex(LLAMA3_WORDS), behavior="isolated")
    return trained(pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))


def qwen2_like() -> Tokenizer:
    split = pre_tokenizers.Split(pattern=_regex(QWEN2_WORDS), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return trained(pre_tokenizers.Sequence([split, byte_level]), normalizers.NFC())


def _regex(pattern: str):
    from tokenizers import Regex

    return Regex(pattern)


def assert_a_lower_bound(tokenizer: Tokenizer, bound: CharBound, texts: list[str]) -> None:
    for text in texts:
        count = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert bound.fewest_tokens(text) <= count, (text, bound)


def test_the_tiny_tokenizer_has_a_bound_its_longest_token(tiny):
    bound = tiny.char_bound()
    longest = max(map(len, tiny._tokenizer.get_vocab(with_added_tokens=True)))
    assert bound.chars_per_token == longest and bound.cuts_before_spaces
    assert bound.fewest_tokens("x" * (10 * longest + 1)) == 11


@pytest.mark.parametrize("make", [lambda: None, llama3_like, qwen2_like])
def test_the_bound_never_exceeds_the_real_count(tiny, make):
    tokenizer = make() or tiny._tokenizer
    bound = char_bound(tokenizer)
    assert bound.chars_per_token is not None
    rng = random.Random(7)
    texts = [random_text(rng, rng.randint(1, 200)) for _ in range(300)]
    # The worst cases: each made of what the vocabulary holds longest, or of characters that compose.
    longest = max(tokenizer.get_vocab(), key=len)
    texts += [piece * 500 for piece in PIECES] + [longest * 100, "e" + "\u0301" * 1000, "\u1100\u1161\u11a8" * 300]
    assert_a_lower_bound(tokenizer, bound, texts)


def test_characters_the_vocabulary_lacks_are_counted_out():
    """The bundled model's byte-level vocabulary has no token for a few ASCII control characters: a text of
    them makes no token at all, so they cannot count towards the bound."""
    tokenizer = trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    vocab = tokenizer.get_vocab()
    lacking = byte_level_chars()[0x13]
    ids = {token: index for token, index in vocab.items() if lacking not in token}
    merges = [tuple(merge.split(" ")) for merge in _merges(tokenizer) if lacking not in merge]
    without = Tokenizer(models.BPE(vocab=dict(zip(ids, range(len(ids)), strict=True)), merges=merges))
    without.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert without.encode("\x13" * 50).ids == []
    bound = char_bound(without)
    assert bound.dropped == frozenset("\x13")
    assert bound.fewest_tokens("\x13" * 1000) == 0 and bound.fewest_tokens("ab\x13\x13") == 1
    assert_a_lower_bound(without, bound, ["\x13" * 1000 + "a", "a\x13b" * 300])


def _merges(tokenizer: Tokenizer) -> list[str]:
    import json

    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [" ".join(merge) if isinstance(merge, list) else merge for merge in merges]


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: trained(pre_tokenizers.Whitespace()), "whitespace makes no token"),
        (lambda: trained(pre_tokenizers.ByteLevel(), normalizers.Strip()), "stripped text"),
        (lambda: trained(pre_tokenizers.Metaspace(), unk_token="<|endoftext|>", fuse_unk=True), "unknowns fused"),
        (lambda: trained(pre_tokenizers.Metaspace()), "unknown characters vanish"),
        (lambda: _wordpiece(), "WordPiece: one [UNK] for a whole long word"),
        (lambda: _with_lstrip(), "an added token that takes the spaces before it"),
        (lambda: _truncating(), "a tokenizer that truncates on its own"),
    ],
)
def test_pipelines_that_fold_any_run_into_one_token_get_no_bound(make, why):
    tokenizer = make()
    assert char_bound(tokenizer).chars_per_token is None, why


def test_no_bound_is_no_refusal():
    assert CharBound().fewest_tokens("x" * 10**6) == 0


def test_a_bound_would_be_wrong_where_none_is_given():
    """The cases above are refused for a reason: one token (or none) for a text of any length."""
    assert len(trained(pre_tokenizers.Whitespace()).encode(" " * 5000).ids) == 0
    fused = trained(pre_tokenizers.Metaspace(), unk_token="<|endoftext|>", fuse_unk=True)
    assert len(fused.encode("\u2603" * 5000, add_special_tokens=False).ids) <= 2
    assert len(_with_lstrip().encode(" " * 5000 + "<mask>").ids) == 1


def _wordpiece() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    return tokenizer


def _with_lstrip() -> Tokenizer:
    tokenizer = trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    return tokenizer


def _truncating() -> Tokenizer:
    tokenizer = trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    tokenizer.enable_truncation(16)
    return tokenizer


def test_normalizers_shrink_by_a_known_factor_or_none():
    assert normalizer_shrink(None) == 1
    assert normalizer_shrink({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}) == 4
    assert normalizer_shrink({"type": "Replace", "pattern": {"String": "  "}, "content": " "}) == 2
    assert normalizer_shrink({"type": "Replace", "pattern": {"String": " "}, "content": ""}) is None
    assert normalizer_shrink({"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}) is None
    assert normalizer_shrink({"type": "BertNormalizer"}) is None


def test_nfc_composes_at_most_max_composed_characters_into_one():
    longest = max(len(unicodedata.normalize("NFD", chr(code))) for code in range(0x110000))
    assert longest == MAX_COMPOSED


@pytest.mark.parametrize("make", [lambda: None, llama3_like, qwen2_like])
def test_the_tail_gives_exactly_the_last_tokens_of_the_whole(tiny, make):
    tokenizer = make()
    wrapped = tiny if tokenizer is None else RustTokenizer(tokenizer, False)
    bound = wrapped.char_bound()
    assert bound.cuts_before_spaces
    rng = random.Random(11)
    cut_somewhere = 0
    for _ in range(150):
        text = random_text(rng, rng.randint(20, 400))
        truncate = rng.randint(1, 30)
        cut = bound.tail_start(text, truncate)
        if cut == 0:
            continue
        cut_somewhere += 1
        whole = wrapped(text, add_special_tokens=False)["input_ids"]
        tail = wrapped(text[cut:], add_special_tokens=False)["input_ids"]
        assert len(tail) >= truncate and whole[-len(tail) :] == tail, (text, cut)
    assert cut_somewhere > 50


def test_a_long_truncated_prompt_is_encoded_from_its_tail_as_from_the_whole(tiny):
    rng = random.Random(3)
    text = random_text(rng, 12_000)
    assert len(text) > LONG_TEXT_CHARS
    bound = tiny.char_bound()
    for truncate in (1, 7, 200):
        for add_special_tokens in (True, False):
            whole = _encode(tiny, text, truncate, add_special_tokens)
            assert _encode(tiny, text, truncate, add_special_tokens, bound) == whole
            assert len(whole.ids) == truncate


def test_no_cut_without_a_word_before_a_space():
    bound = CharBound(chars_per_token=4, cuts_before_spaces=True)
    assert bound.tail_start("!!!! " * 100, 3) == 0
    assert bound.tail_start("x" * 1000, 3) == 0
    text = "a " * 100
    cut = bound.tail_start(text, 3)
    assert text[cut] == " " and text[cut - 1] == "a" and len(text) - cut >= 12
    assert CharBound(chars_per_token=4).tail_start(text, 3) == 0
