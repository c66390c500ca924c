"""Incremental detokenization: the text each generated token adds, in TGI's prefix/read-offset scheme.

Decoding one token alone is wrong in two ways: sentencepiece tokenizers drop the leading space of the first
token of a decode ("▁world" → "world"), and a byte-level or byte-fallback token can end inside a multi-byte
UTF-8 character. So each step decodes a short window that starts a few tokens back (`prefix_offset`) and
returns only what that window adds beyond the already-emitted part (up to `read_offset`), and holds the text
back ("") while it ends in U+FFFD, an incomplete character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Prompt tokens kept as context before the first generated token.
CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def decoder_of(tokenizer: Any) -> Callable[[list[int]], str]:
    """A decode function keeping special tokens and doing no space clean-up (which cannot be incremental).

    It calls the Rust tokenizer directly when there is one: half the per-token cost of `tokenizer.decode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Turns one request's generated ids into text pieces, one `step` per token.

    The pieces concatenate to the text the generated tokens add after the prompt: with a byte-level tokenizer
    that is `tokenizer.decode(generated_ids)`; with a sentencepiece one the first piece keeps the leading space
    that a stand-alone decode would strip (as TGI does). `text()` gives the whole generation the same way.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._decode = decoder_of(tokenizer)
        self._context = [int(i) for i in prompt_ids[-CONTEXT_TOKENS:]]
        self.generated: list[int] = []
        # The window being decoded: ids from prefix_offset on; text up to read_offset is already emitted.
        self._window = list(self._context)
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)

    def step(self, token_id: int) -> str:
        """The text `token_id` completes: "" while the output ends in an incomplete UTF-8 character."""
        self.generated.append(token_id)
        self._window.append(token_id)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        piece = text[len(self._prefix_text) :]
        # Slide: the ids emitted before this step become the next window's context.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return piece

    def flush(self) -> str:
        """At the end of a generation, the whole characters still held back. A token can complete one character and
        begin another (byte-level merges cross character boundaries): `step` then held both back, and a stream that
        ends there would never show the completed one. The incomplete tail stays out, as in the final text's
        clients strip it."""
        text = self._decode(self._window)
        return text[len(self._prefix_text) :].rstrip(REPLACEMENT_CHAR) if len(text) > len(self._prefix_text) else ""

    def text(self, skip_special_tokens: bool = True) -> str:
        """All generated text, decoded in the prompt's context like the pieces (for `generated_text`)."""
        decode = self._tokenizer.decode
        options = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
        context = decode(self._context, **options)
        full = decode(self._context + self.generated, **options)
        return full[len(context) :] if full.startswith(context) else decode(self.generated, **options)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids the API reports with `special: true`: the named special tokens and added tokens marked special."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(ids)


def is_special(tokenizer: Any, token_id: int) -> bool:
    """Whether `token_id` is special. Builds the set each call: hot paths keep `special_token_ids` instead."""
    return token_id in special_token_ids(tokenizer)
