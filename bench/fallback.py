"""Throughput of the transformers fallback: padded batches vs one request per forward, with transformers'
own batched `generate` as the baseline, all in one run (ratios hold on a busy machine; absolute numbers not).

    PYTHONPATH=. .venv/bin/python bench/fallback.py          # 8 requests x 32 new tokens, GPT-Neo 4x512 random
    PYTHONPATH=. .venv/bin/python bench/fallback.py --requests 16 --new-tokens 64 --threads 2

Method: a random-weight GPT-Neo (no native implementation in Kettle, so it runs through the fallback) with the
tiny test tokenizer; prompts of 8, 12, ... tokens (different lengths, so padding is real). Each mode runs the
shard engine directly (no HTTP): one prefill of all requests, then decode steps until all have `--new-tokens`
(EOS ignored). Each mode runs `--trials` times; its best run is printed as tokens/s.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from kettle import settings
from tests.fixtures import make_tokenizer
from tests.models.fallback_helpers import make_batch, run_to_end, warm_engine


def build_model(path: Path) -> None:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    tokenizer = make_tokenizer(path)
    config = GPTNeoConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        attention_types=[[["global"], 4]],
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    GPTNeoForCausalLM(config).save_pretrained(path)


def kettle_seconds(path: Path, prompts: list[list[int]], new_tokens: int, padding: str) -> float:
    os.environ["KETTLE_FALLBACK_PADDING"] = padding
    settings.reload()  # the process reads its settings once: read them again for this engine
    engine, _ = warm_engine(path)
    start = time.perf_counter()
    run_to_end(engine, make_batch(1, prompts, 1, new_tokens))
    return time.perf_counter() - start


def transformers_seconds(path: Path, prompts: list[list[int]], new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(tempfile.mkdtemp(prefix="kettle-bench-fallback-"))
    build_model(path)
    prompts = [[5 + i] * (8 + 4 * i) for i in range(args.requests)]
    modes = {
        "kettle fallback, padded batch": lambda: kettle_seconds(path, prompts, args.new_tokens, "1"),
        "kettle fallback, one request per forward": lambda: kettle_seconds(path, prompts, args.new_tokens, "0"),
        "transformers generate (left-padded batch)": lambda: transformers_seconds(path, prompts, args.new_tokens),
    }
    best = {name: min(run() for _ in range(args.trials)) for name, run in modes.items()}
    generated = args.requests * args.new_tokens
    for name, seconds in best.items():
        print(f"{name:45s} {generated / seconds:8.1f} tokens/s  ({seconds:.2f} s)")


if __name__ == "__main__":
    main()
