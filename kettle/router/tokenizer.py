"""Tokenization off the event loop: a pool of `--validation-workers` threads, one tokenizer copy each.

A transformers fast tokenizer mutates its Rust backend's truncation/padding state on every call, so sharing one
across threads can fail with "Already borrowed"; each worker thread therefore loads its own copy.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kettle.router.schemas import SimpleToken

TokenizerFactory = Callable[[], Any]


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

    @classmethod
    def from_path(cls, path: str, workers: int) -> TokenizerPool:
        """A pool loading `AutoTokenizer.from_pretrained(path)` once per worker thread."""
        from transformers import AutoTokenizer

        return cls(lambda: AutoTokenizer.from_pretrained(path), workers)

    async def warm(self) -> None:
        """Loads the tokenizer in every worker now, so the first requests do not pay for it."""
        # The barrier holds each worker until all have one task: no thread can take a second and leave one cold.
        barrier = threading.Barrier(self._workers)
        await asyncio.gather(*(self._run(_wait_at, barrier) for _ in range(self._workers)))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def encode(self, text: str, truncate: int | None, add_special_tokens: bool = True) -> Encoded:
        """Token ids (special tokens added unless told not to); with `truncate`, only the last `truncate` kept."""
        return await self._run(_encode, text, truncate, add_special_tokens)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[SimpleToken]:
        """Tokens with their text and byte offsets into `text` (special tokens added by default, no truncation)."""
        return await self._run(_tokenize, text, add_special_tokens)

    async def _run(self, work: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, work, args)

    def _call(self, work: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = self._factory()
        return work(tokenizer, *args)


def _wait_at(_tokenizer: Any, barrier: threading.Barrier) -> None:
    barrier.wait(timeout=60)


def _encode(tokenizer: Any, text: str, truncate: int | None, add_special_tokens: bool) -> Encoded:
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    if truncate is None or len(ids) <= truncate:
        return Encoded(tuple(ids), text)
    kept = ids[-truncate:]
    # Special tokens stay in the text: it is what the shard's prompt really is.
    return Encoded(tuple(kept), tokenizer.decode(kept, skip_special_tokens=False))


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
    """Byte offset of every character position (transformers reports character offsets, TGI bytes)."""
    offsets = [0]
    for char in text:
        offsets.append(offsets[-1] + len(char.encode("utf-8")))
    return offsets
