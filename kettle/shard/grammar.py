"""Constrained decoding on the shard (docs/api.md, Structured output and tools): per-request grammar matchers and the
batch's token mask.

The engine is llguidance (`python -m bench decode --vs grammar-engines` compares it with xgrammar and outlines-core):
near-zero grammar compile time (its lexer is built lazily while masking), masks of a few hundred µs per row
on the bundled model's 49k vocabulary, JSON Schema and regular expressions with precise error messages, and
no dependency beyond itself.

Each request with a grammar owns an `LLMatcher`, advanced only with the tokens it actually sampled (a prefill
chunk that is not the prompt's last one samples nothing, so it never reaches the matcher). Per step, the
masks of all constrained rows are computed in one call into one int32 bitmask, copied to the device once and
unpacked there into the [B, V] bool mask that `BatchSampler` applies.

Ending: where the grammar may stop but could go on, EOS is among the allowed tokens and the model chooses.
Where nothing can follow (the JSON object is closed), the matcher stops and the request ends at once with
finish reason `eos_token`. TGI instead spends one more forward on a forced EOS token; skipping it saves that
step and the answer is the same, except that `generated_tokens` does not count a final EOS.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from copy import copy
from functools import lru_cache
from typing import Any

import llguidance
import torch

from kettle.grammar import grammar_text
from kettle.process_memory import release_free_memory
from kettle.proto import generate_pb2

# Matchers computed per step on one thread: it keeps the shard's CPU budget predictable on small machines.
_THREADS = 1
_BITS = 32


class Grammars:
    """The shard's grammar support: the llguidance view of the tokenizer, new matchers, and the per-step mask.

    The tokenizer view is built on the first grammar request: ~0.26 s once for the bundled model's 49k
    vocabulary, against ~40 MiB resident for the whole life of a shard that may never see a grammar (it keeps
    its own copy of the Rust tokenizer and a token trie)."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        # The grammar ends on one EOS id; it must be one the stopping criteria stop on.
        own = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id = own if own in eos_token_ids or not eos_token_ids else min(eos_token_ids)
        self._executor = llguidance.LLExecutor(num_threads=_THREADS)
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._prototype = lru_cache(maxsize=64)(self._prototype)  # type: ignore[method-assign]

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # matchers are built on the engine thread, but nothing here requires it
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(self._tokenizer, self.eos_token_id)
                release_free_memory()  # the serialized tokenizer and llguidance's parse of it
            return self._ll_tokenizer

    def matcher(self, parameters: generate_pb2.NextTokenChooserParameters) -> llguidance.LLMatcher | None:
        """A fresh matcher for a request's grammar, or None when it has none."""
        if parameters.grammar_type == generate_pb2.GRAMMAR_TYPE_NONE:
            return None
        return self._prototype(parameters.grammar_type, parameters.grammar).deep_copy()

    def _prototype(self, grammar_type: int, text: str) -> llguidance.LLMatcher:
        # Copying a compiled matcher is ~100x cheaper than building one (measured: 5 µs vs 4 ms on the bundled
        # model) and shares the lexer work done so far, so matchers are cached per grammar (LRU) and copied.
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(grammar_type, text))
        if matcher.is_error():
            raise ValueError(f"grammar is not valid: {matcher.get_error()}")
        return matcher

    def mask(self, matchers: Sequence[llguidance.LLMatcher | None], width: int, device: torch.device) -> torch.Tensor:
        """[B, width] bool, True = allowed. Rows without a matcher allow everything; constrained rows allow
        nothing past the tokenizer's vocabulary (the columns of a padded lm_head)."""
        vocab = self.ll_tokenizer.vocab_size
        bitmask = torch.full((len(matchers), -(-vocab // _BITS)), -1, dtype=torch.int32)
        constrained = [(m, row) for row, m in enumerate(matchers) if m is not None]
        # What `llguidance.torch.fill_next_token_bitmask_par` does, called directly: that module compiles a
        # kernel with `torch.compile` at import, which loads torch._dynamo and torch._inductor (~1.7 s and tens
        # of MB resident in every shard) for a function Kettle never calls.
        self._executor.unsafe_compute_mask_ptr(constrained, bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))
        mask = self._unpack(bitmask.to(device, non_blocking=True), min(vocab, width))
        if width > vocab:
            free = torch.tensor([m is None for m in matchers], device=device).unsqueeze(1)
            mask = torch.cat([mask, free.expand(-1, width - vocab)], dim=1)
        # A matcher in an error state allows nothing; let it end instead of sampling from all -inf.
        mask[:, self.eos_token_id] |= ~mask.any(dim=-1)
        return mask

    def _unpack(self, bitmask: torch.Tensor, width: int) -> torch.Tensor:
        shifts = self._shifts.get(bitmask.device)
        if shifts is None:
            shifts = self._shifts[bitmask.device] = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
        return ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :width].bool()


def ll_tokenizer(tokenizer: Any, eos_token_id: int | None) -> llguidance.LLTokenizer:
    """llguidance's view of a fast tokenizer (a transformers one or the shard's `FileTokenizer`), built as
    `llguidance.hf.from_tokenizer` builds it (that module imports transformers): the Rust tokenizer serialized
    without padding or truncation, over `len(tokenizer)` ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("Only fast tokenizers are supported")
    # A copy: the tokenizer shared with the detokenizers keeps its own settings.
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=len(tokenizer), eos_token=eos_token_id)


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Feeds a sampled token to the matcher; True when the grammar is finished (the request must stop)."""
    matcher.consume_token(token)
    return matcher.is_stopped() or matcher.is_error()
