"""Compares grammar engines (xgrammar, llguidance, outlines-core) on the bundled model's tokenizer.

For one JSON schema: compile time (cold, new compiler each time), the first mask (which includes any work an
engine defers from compiling), and the median per-step time to build a [B, V] bool mask for batch 1 and 8 along
a fixed valid output, advancing each matcher with the token. Run:

    .venv/bin/python bench/grammar_engines.py [MODEL_DIR]

Prints one markdown row per engine. Times are medians; the machine's noise applies to all engines alike.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
}
OUTPUT = '{"name":"Ada Lovelace","age":36,"email":"ada@example.org","tags":["math","poet"],"active":true}'


def model_dir() -> Path:
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    return max((Path.home() / ".cache/kettle/models").glob("SmolLM2-135M-Instruct*"), key=lambda p: p.stat().st_mtime)


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size, eos):
        import xgrammar as xgr

        self.xgr = xgr
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)

    def compile(self):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled, n):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def mask(self, matchers, bitmask, vocab):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return unpack(bitmask, vocab)

    def alloc(self, n, vocab):
        return self.xgr.allocate_token_bitmask(n, vocab)

    def advance(self, matcher, token):
        assert matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size, eos):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos[0])
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        )
        matcher = self.ll.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matchers(self, grammar, n):
        return [self.ll.LLMatcher(self.tok, grammar) for _ in range(n)]

    def mask(self, matchers, bitmask, vocab):
        self.ll.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return unpack(bitmask, vocab)

    def alloc(self, n, vocab):
        return self.ll.torch.allocate_token_bitmask(n, vocab)

    def advance(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size, eos):
        from outlines_core import Vocabulary

        decoder = {v: k for k, v in bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        special = set(tokenizer.all_special_ids)
        for text, i in tokenizer.get_vocab().items():
            if i in special:
                continue
            tokens.setdefault(bytes(decoder[c] for c in text), []).append(i)
        self.vocabulary = Vocabulary(eos[0], tokens)

    def compile(self):
        from outlines_core import Index, json_schema

        regex = json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
        return Index(regex, self.vocabulary)

    def matchers(self, index, n):
        from outlines_core import Guide

        return [Guide(index) for _ in range(n)]

    def mask(self, guides, bitmask, vocab):
        from outlines_core.kernels.torch import fill_next_token_bitmask

        for i, guide in enumerate(guides):
            fill_next_token_bitmask(guide, bitmask[i : i + 1])
        return unpack(bitmask, vocab)

    def alloc(self, n, vocab):
        from outlines_core.kernels.torch import allocate_token_bitmask

        return allocate_token_bitmask(vocab).repeat(n, 1)

    def advance(self, guide, token):
        guide.advance(token)


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmask [B, ceil(V/32)] → bool [B, V]; one tensor op for the batch."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1
    return bits.flatten(1)[:, :vocab].bool()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-character table (byte-level BPE token spelling)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def run(engine_cls, tokenizer, vocab_size, eos, output_ids) -> str:
    start = time.perf_counter()
    engine = engine_cls(tokenizer, vocab_size, eos)
    setup = time.perf_counter() - start
    compile_s = timed(engine.compile, 3)
    compiled = engine.compile()
    per_token, first = {}, {}
    for batch in (1, 8):
        matchers = engine.matchers(compiled, batch)
        bitmask = engine.alloc(batch, vocab_size)
        times = []
        for token in output_ids:
            start = time.perf_counter()
            mask = engine.mask(matchers, bitmask, vocab_size)
            times.append(time.perf_counter() - start)
            assert bool(mask[0, token]), f"{engine.name}: token {token} masked out"
            for matcher in matchers:
                engine.advance(matcher, token)
        per_token[batch], first[batch] = statistics.median(times), times[0]
    return (
        f"| {engine.name} | {setup * 1e3:.0f} | {compile_s * 1e3:.1f} | {first[1] * 1e3:.1f} | "
        f"{per_token[1] * 1e6:.0f} | {per_token[8] * 1e6:.0f} |"
    )


def main() -> None:
    torch.set_num_threads(1)
    folder = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab_size = len(tokenizer)
    eos = [tokenizer.eos_token_id]
    output_ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    print(f"model {folder.name}, vocabulary {vocab_size}, {len(output_ids)} output tokens")
    print(
        "| engine | tokenizer setup (ms) | schema compile (ms) | first mask (ms) | mask/token B=1 (µs) "
        "| mask/step B=8 (µs) |"
    )
    print("|---|---|---|---|---|---|")
    for engine in (XGrammar, LLGuidance, OutlinesCore):
        try:
            print(run(engine, tokenizer, vocab_size, eos, output_ids), flush=True)
        except Exception as exc:  # one engine failing must not hide the others' numbers
            print(f"| {engine.name} | failed: {exc!r} |", flush=True)


if __name__ == "__main__":
    main()
