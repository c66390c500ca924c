"""Tokenization off the event loop: a pool of `--validation-workers` threads, one tokenizer copy each.

A fast tokenizer mutates its Rust backend's truncation/padding state on every call, so sharing one across
threads can fail with "Already borrowed"; each worker thread therefore loads its own copy.

The router reads a folder's `tokenizer.json` with the `tokenizers` library itself (`RustTokenizer`), as TGI's
router does: transformers' AutoTokenizer would import torch into the router (measured on the bundled model:
~370 MB resident and ~3.4 s to load, against ~50 MB and 0.1 s). transformers still serves folders without a
tokenizer.json (slow, SentencePiece-only tokenizers), and those whose tokenizer_config.json asks for a BOS or EOS
the file's post-processor does not add (transformers rebuilds the post-processor from those flags).

Long texts (over `LONG_TEXT_CHARS`) cost memory: a `truncate`d one is tokenized from its tail where the tokenizer
allows it (char_bound.py), and after any of them the worker hands the C heap's free pages back (`malloc_trim`):
the tokenizer's buffers are freed, but glibc kept them resident (~450 MiB after 20 prompts of 1.9 MB).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kettle.process_memory import release_free_memory
from kettle.router.char_bound import NO_BOUND, CharBound, char_bound
from kettle.router.schemas import SimpleToken

TokenizerFactory = Callable[[], Any]
# From this length on a text's tokenizing takes tens of MB (~250 bytes a character): worth a trim afterwards, and
# under `truncate` worth tokenizing only the tail. Below it, the freed memory is simply reused by the next ones.
LONG_TEXT_CHARS = 1 << 16


@dataclass(frozen=True)
class Encoded:
    """A prompt after tokenization and truncation; `text` is the decode of the kept tokens when truncated."""

    ids: tuple[int, ...]
    text: str


class TokenizerPool:
    """Runs tokenizer calls on `workers` threads, each with its own tokenizer from `factory`."""

    def __init__(self, factory: TokenizerFactory, workers: int) -> None:
        self._factory = factory
        self._workers = workers
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kettle-tokenizer")
        self._bound: CharBound | None = None
        self._bound_lock = threading.Lock()

    @classmethod
    def from_path(cls, path: str, workers: int) -> TokenizerPool:
        """A pool loading the tokenizer at `path` (`load_tokenizer`) once per worker thread."""
        return cls(lambda: load_tokenizer(path), workers)

    async def warm(self) -> None:
        """Loads the tokenizer in every worker now, so the first requests do not pay for it."""
        # The barrier holds each worker until all have one task: no thread can take a second and leave one cold.
        barrier = threading.Barrier(self._workers)
        await asyncio.gather(*(self._run(lambda _tokenizer: barrier.wait(timeout=60)) for _ in range(self._workers)))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def bound(self) -> CharBound:
        """What the tokenizer's pipeline guarantees about a text's tokens from its length (char_bound.py); known
        once a worker has loaded its tokenizer (`warm`), no bound before."""
        return self._bound or NO_BOUND

    async def encode(self, text: str, truncate: int | None, add_special_tokens: bool = True) -> Encoded:
        """Token ids (special tokens added unless told not to); with `truncate`, only the last `truncate` kept."""

        def work(tokenizer: Any) -> Encoded:
            return _encode(tokenizer, text, truncate, add_special_tokens, self.bound)

        return await self._run(work, long=len(text) > LONG_TEXT_CHARS)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[SimpleToken]:
        """Tokens with their text and byte offsets into `text` (special tokens added by default, no truncation)."""
        return await self._run(
            lambda tokenizer: _tokenize(tokenizer, text, add_special_tokens), long=len(text) > LONG_TEXT_CHARS
        )

    async def _run(self, work: Callable[[Any], Any], long: bool = False) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, work, long)

    def _call(self, work: Callable[[Any], Any], long: bool) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = self._factory()
            self._learn_bound(tokenizer)
        try:
            return work(tokenizer)
        finally:
            if long:
                release_free_memory()

    def _learn_bound(self, tokenizer: Any) -> None:
        """Reads the bound from the first tokenizer loaded (every worker's is the same); only a `RustTokenizer`
        has one: transformers may rebuild the pipeline its own way, or run Python code before it."""
        with self._bound_lock:
            if self._bound is None:
                self._bound = tokenizer.char_bound() if isinstance(tokenizer, RustTokenizer) else NO_BOUND


class RustTokenizer:
    """A folder's tokenizer.json through the `tokenizers` library, with the two calls the router makes on a
    transformers tokenizer: `tokenizer(text, add_special_tokens=..., return_offsets_mapping=...)` and `decode`."""

    def __init__(self, tokenizer: Any, clean_up_spaces: bool) -> None:
        self._tokenizer, self._clean_up_spaces = tokenizer, clean_up_spaces

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False) -> dict:
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        out = {"input_ids": encoding.ids}
        if return_offsets_mapping:
            out["offset_mapping"] = encoding.offsets
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up_spaces else text

    def char_bound(self) -> CharBound:
        return char_bound(self._tokenizer)


def _clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization` (spaces before punctuation and English contractions)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(before, after)
    for suffix in ("'m", "'s", "'ve", "'re"):
        text = text.replace(f" {suffix}", suffix)
    return text


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the folder `path`: its tokenizer.json read directly when that is what transformers would
    load too (module docstring), else transformers' AutoTokenizer."""
    folder = Path(path)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        if _adds_what_the_config_asks(tokenizer, config):
            return RustTokenizer(tokenizer, bool(config.get("clean_up_tokenization_spaces", False)))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _adds_what_the_config_asks(tokenizer: Any, config: dict) -> bool:
    """Whether the file's post-processor adds the BOS / EOS tokens exactly when tokenizer_config.json's
    `add_bos_token` / `add_eos_token` say so (where they say anything)."""
    ids = tokenizer.encode("a", add_special_tokens=True).ids
    for flag, key, position in (("add_bos_token", "bos_token", 0), ("add_eos_token", "eos_token", -1)):
        if flag not in config:
            continue
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        token_id = tokenizer.token_to_id(token) if token else None
        added = token_id is not None and bool(ids) and ids[position] == token_id
        if added != bool(config[flag]):
            return False
    return True


def _encode(
    tokenizer: Any, text: str, truncate: int | None, add_special_tokens: bool, bound: CharBound = NO_BOUND
) -> Encoded:
    if truncate is not None and len(text) > LONG_TEXT_CHARS:
        cut = bound.tail_start(text, truncate)
        suffix = _special_suffix(tokenizer) if cut else None
        if suffix is not None:
            # The tail's own tokens are the whole text's last ones (CharBound.tail_start), then what the
            # post-processor adds after a text; what it adds before is beyond the last `truncate` anyway.
            ids = tokenizer(text[cut:], add_special_tokens=False)["input_ids"]
            if len(ids) > truncate:  # else characters that make no token left it short: the whole text then
                kept = [*ids, *(suffix if add_special_tokens else ())][-truncate:]
                return Encoded(tuple(kept), tokenizer.decode(kept, skip_special_tokens=False))
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    if truncate is None or len(ids) <= truncate:
        return Encoded(tuple(ids), text)
    kept = ids[-truncate:]
    # Special tokens stay in the text: it is what the shard's prompt really is.
    return Encoded(tuple(kept), tokenizer.decode(kept, skip_special_tokens=False))


def _special_suffix(tokenizer: Any) -> list[int] | None:
    """The special tokens the tokenizer adds after a text; None if its text's tokens are not kept whole between
    what it adds before and after."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    marked = tokenizer("a", add_special_tokens=True)["input_ids"]
    if not plain:
        return None
    for start in range(len(marked) - len(plain) + 1):
        if marked[start : start + len(plain)] == plain:
            return marked[start + len(plain) :]
    return None


def _tokenize(tokenizer: Any, text: str, add_special_tokens: bool) -> list[SimpleToken]:
    encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    raw = text.encode("utf-8")
    byte_at = _char_to_byte_offsets(text)
    tokens = []
    for token_id, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True):
        begin, end = byte_at[start], byte_at[stop]
        tokens.append(SimpleToken(id=token_id, text=raw[begin:end].decode("utf-8", "replace"), start=begin, stop=end))
    return tokens


def _char_to_byte_offsets(text: str) -> list[int]:
    """Byte offset of every character position (the tokenizers report character offsets, TGI bytes)."""
    offsets = [0]
    for char in text:
        offsets.append(offsets[-1] + len(char.encode("utf-8")))
    return offsets
