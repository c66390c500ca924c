"""What a prompt's length in characters says about its tokens, before any tokenizing.

A prompt far over the token limits used to be tokenized whole before it was refused: on the bundled model ~250
bytes of the router's memory per character, ~450 MiB for one 1.9 MB prompt, most of which glibc kept afterwards.
But when a tokenizer turns every character of its input into (part of) some token and no token stands for more
than `chars_per_token` characters, a text of n characters has at least ceil(n / chars_per_token) tokens, and a
prompt over the limits by that count alone is refused without the tokenizer.

Whether a tokenizer qualifies is read from its pipeline: the normalizer must not shorten the text (or only by a
bounded factor: NFC and NFKC compose at most `MAX_COMPOSED` characters into one), the pre-tokenizer must split
without removing anything, and the BPE model must have a token for every byte (the byte-level alphabet, or byte
fallback) or an unknown token per unknown character. A byte-level vocabulary may lack a few ASCII control
characters (the bundled model's has no token for 6 of them): those characters make no token at all, so they are
counted out of the length. Whitespace splitting (BERT), WordPiece (one [UNK] for a whole
over-long word), Unigram (unknown characters fused), an added token that swallows the spaces beside it, and a
tokenizer that truncates on its own all break the rule: they get no bound, and every prompt is tokenized.

The same reading says when a prompt's last tokens can be had from its tail alone (`truncate` keeps the last N):
see `CharBound.tail_start`.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

# The longest canonical decomposition of one code point (U+1F82 and its kin: 4 code points). NFC and NFKC
# recompose at most that many characters of their input into one of their output.
MAX_COMPOSED = 4
# Where to look for a place to cut a long prompt (`tail_start`): a prompt with no ASCII word followed by a space
# in this many characters before the cut is tokenized whole, as every prompt used to be.
CUT_SEARCH_CHARS = 1 << 16
_WORD_END = frozenset(string.ascii_letters + string.digits)

# Word-splitting patterns under which an ASCII letter or digit followed by an ASCII space always ends one word and
# starts the next: every alternative that takes a letter or digit stops at whitespace, and whitespace always
# starts a match. These patterns look ahead but never behind, so splitting a text from such a place on gives the
# same words as splitting the whole text. GPT-2's (also ByteLevel's built-in one), Llama 3's and Qwen 2's.
GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_WORDS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_WORDS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_WORD_PATTERNS = frozenset((GPT2_WORDS, LLAMA3_WORDS, QWEN2_WORDS))
# Normalizers that work character by character, or compose only across combining marks (which a space blocks).
_LOCAL_NORMALIZERS = frozenset(("NFC", "NFKC", "NFD", "NFKD", "Lowercase"))


@dataclass(frozen=True)
class CharBound:
    """What a tokenizer's pipeline guarantees about the tokens of a text of a given length.

    `chars_per_token`: no token stands for more characters of the input than this (None: no such bound).
    `dropped`: the characters that make no token (ASCII ones a byte-level vocabulary lacks); every other
    character is (part of) some token.
    `cuts_before_spaces`: tokenizing a text from an ASCII space that follows an ASCII letter or digit gives exactly
    the tokens the whole text has from there on (the prompt's tail can stand for the whole under `truncate`).
    """

    chars_per_token: int | None = None
    dropped: frozenset[str] = frozenset()
    cuts_before_spaces: bool = False

    def fewest_tokens(self, text: str) -> int:
        """The fewest tokens `text` can have (special tokens not counted); 0 when there is no bound."""
        if not self.chars_per_token:
            return 0
        length = len(text) - sum(text.count(char) for char in self.dropped)
        return -(-length // self.chars_per_token)

    def tail_start(self, text: str, tokens: int) -> int:
        """Where to start tokenizing `text` to get its last `tokens` tokens exactly; 0 means the whole text.

        The cut is an ASCII space after an ASCII letter or digit, at least `tokens * chars_per_token` characters
        from the end: the tail then has at least `tokens` tokens of its own (unless it holds `dropped` characters:
        the caller checks the count), and they are the whole text's last ones.
        """
        if not self.cuts_before_spaces or self.chars_per_token is None:
            return 0
        latest = len(text) - tokens * self.chars_per_token
        if latest < 1:
            return 0  # (and rfind would read a negative end from the end of the text)
        earliest = max(latest - CUT_SEARCH_CHARS, 1)
        space = text.rfind(" ", earliest, latest + 1)
        while space >= earliest:
            if text[space - 1] in _WORD_END:
                return space
            space = text.rfind(" ", earliest, space)
        return 0


NO_BOUND = CharBound()


def char_bound(tokenizer: Any) -> CharBound:
    """The bound of a `tokenizers.Tokenizer`, read from its normalizer, pre-tokenizer, model and added tokens."""
    if tokenizer.truncation is not None:
        return NO_BOUND  # it would cut long texts short itself: length says nothing about its count
    added = tokenizer.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip for token in added):
        return NO_BOUND  # such a token takes every space before or after it: one token for any number
    normalizer = _state(tokenizer.normalizer)
    pre_tokenizer = _state(tokenizer.pre_tokenizer)
    shrink = normalizer_shrink(normalizer)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if shrink is None or not keeps_every_char(pre_tokenizer) or not vocab:
        return NO_BOUND
    dropped = _dropped_chars(tokenizer.model, vocab, normalizer, pre_tokenizer)
    if dropped is None or (dropped and not _is_local(normalizer)):
        return NO_BOUND  # (a normalizer that is not local might turn other characters into dropped ones)
    chars_per_token = math.ceil(max(map(len, vocab)) * shrink)
    cuts = (
        splits_words_at_spaces(pre_tokenizer)
        and _is_local(normalizer)
        and getattr(tokenizer.model, "dropout", None) is None  # dropout makes any two tokenizations differ
        and not any(" " in token.content for token in added)  # no added token can span the cut
    )
    return CharBound(chars_per_token, dropped, cuts)


def normalizer_shrink(state: dict | None) -> Fraction | None:
    """By how much the normalizer `state` (its JSON) may shorten a text at most (1: never); None: without bound."""
    if state is None:
        return Fraction(1)
    kind = state.get("type")
    if kind == "Sequence":
        product = Fraction(1)
        for step in state.get("normalizers", []):
            shrink = normalizer_shrink(step)
            if shrink is None:
                return None
            product *= shrink
        return product
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):
        return Fraction(1)  # each character becomes one or more; Prepend only adds
    if kind in ("NFC", "NFKC"):
        return Fraction(MAX_COMPOSED)
    if kind == "Replace":
        pattern, content = state.get("pattern", {}).get("String"), state.get("content", "")
        # A regular expression may match any length; a literal of p characters becomes len(content).
        return Fraction(len(pattern), len(content)) if pattern and content else None
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, Nmt: they remove characters


def keeps_every_char(state: dict | None) -> bool:
    """Whether the pre-tokenizer `state` (its JSON) leaves every character in some piece."""
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(keeps_every_char(step) for step in state.get("pretokenizers", []))
    if kind in ("ByteLevel", "Metaspace", "Digits"):
        return True
    if kind in ("Split", "Punctuation"):
        return state.get("behavior") != "Removed"
    return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop their separators


def splits_words_at_spaces(state: dict | None) -> bool:
    """Whether the pre-tokenizer `state` splits words by one of the patterns of `_WORD_PATTERNS`, byte-level."""
    if state is None:
        return False
    if state.get("type") == "ByteLevel":
        return bool(state.get("use_regex", True))  # its built-in pattern is GPT-2's
    if state.get("type") != "Sequence":
        return False
    steps = state.get("pretokenizers", [])
    if len(steps) != 2:
        return False
    split, byte_level = steps
    return (
        split.get("type") == "Split"
        and split.get("pattern", {}).get("Regex") in _WORD_PATTERNS
        and split.get("behavior") == "Isolated"
        and not split.get("invert", False)
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex", True)
    )


def _is_local(state: dict | None) -> bool:
    if state is None:
        return True
    if state.get("type") == "Sequence":
        return all(_is_local(step) for step in state.get("normalizers", []))
    return state.get("type") in _LOCAL_NORMALIZERS


def _dropped_chars(
    model: Any, vocab: dict[str, int], normalizer: dict | None, pre: dict | None
) -> frozenset[str] | None:
    """The characters the model makes no token for, when every other one gets at least one: a BPE with every
    byte, or an unknown token for each unknown character (a fused one stands for a whole run of them). None
    when some character may vanish into a longer token or make none but cannot be told by itself."""
    if type(model).__name__ != "BPE":
        return None  # WordPiece, Unigram and WordLevel each have a way to stand one token for a long run
    if model.unk_token is not None and model.unk_token in vocab and not model.fuse_unk:
        return frozenset()
    if model.byte_fallback and all(f"<0x{byte:02X}>" in vocab for byte in range(256)):
        return frozenset()
    if not (_has_byte_level(pre) or _has_byte_level(normalizer, "normalizers")):
        return None
    missing = {byte for byte, char in enumerate(byte_level_chars()) if char not in vocab}
    # Every character of two or more bytes has continuation bytes (0x80-0xBF): with all of those present it
    # always touches a token. Bytes no UTF-8 text holds (0xC0, 0xC1, 0xF5-0xFF) do not matter.
    if any(0x80 <= byte <= 0xBF for byte in missing):
        return None
    return frozenset(chr(byte) for byte in missing if byte < 0x80)


def byte_level_chars() -> list[str]:
    """The character a byte-level tokenizer writes for each byte, by byte (GPT-2's `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)]


def _has_byte_level(state: dict | None, steps: str = "pretokenizers") -> bool:
    if state is None:
        return False
    if state.get("type") == "Sequence":
        return any(_has_byte_level(step, steps) for step in state.get(steps, []))
    return state.get("type") == "ByteLevel"


def _state(component: Any) -> dict | None:
    """A normalizer's or pre-tokenizer's configuration, as tokenizer.json spells it."""
    return None if component is None else json.loads(component.__getstate__())
