"""Kettle over HTTP vs transformers `generate` on the same model and prompts, in one run.

    .venv/bin/python bench/compare.py                 # bundled SmolLM2-135M, 128 new tokens, 1/4/8/16 streams

Prints single-stream decode tokens/s for both, aggregate tokens/s of Kettle at each concurrency, and the ratios
(bars for issue 2: single stream >= 1.0x transformers; 16 streams >= 6x Kettle's own single stream).
Prompts go through the model's chat template (an instruct model answers raw prompts with EOS at once) and
ask for long answers. Greedy decoding: both engines stop at EOS at the same token, and each side's rate counts
the tokens it made.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from kettle.bench.loadgen import run_load
from kettle.bench.process import KettleServer

PROMPTS = [
    "Write a long story about a dragon who learns to cook.",
    "Explain in detail how a steam engine works.",
    "Write an essay about the history of the printing press.",
    "Describe a walk through a busy market in Marrakesh.",
    "Explain why the sky is blue, step by step, for a child.",
    "Write a detailed recipe for bread, with every step explained.",
    "Tell me about the life of a honey bee from egg to adult.",
    "Write a letter to a friend describing your summer holiday.",
    "Explain how computers store numbers in memory.",
    "Describe the water cycle and why it matters for farming.",
    "Write a short play about two robots meeting for the first time.",
    "Explain the rules of chess to a beginner.",
    "Describe how a city changes from morning to night.",
    "Write a product review of an imaginary electric bicycle.",
    "Explain how vaccines train the immune system.",
    "Write a travel guide for a small mountain village.",
]


def chat_prompts(model_path: str) -> list[str]:
    """PROMPTS rendered with the model's chat template, as text (Kettle tokenizes it the same way)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if not tokenizer.chat_template:
        return PROMPTS
    render = tokenizer.apply_chat_template
    return [render([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in PROMPTS]


def transformers_rates(model_path: str, prompts: list[str], max_new_tokens: int) -> list[float]:
    """Batch-1 greedy `generate` tokens/s per prompt (fp32), on the same texts Kettle gets."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    from kettle.hub.resolve import float_folder

    model = AutoModelForCausalLM.from_pretrained(float_folder(model_path), dtype=torch.float32).eval()
    rates = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
        rates.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=None, help="model to serve (default: the bundled SmolLM2)")
    parser.add_argument("--streams", default="1,4,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--baseline-prompts", type=int, default=4, help="prompts timed through transformers")
    args = parser.parse_args()
    from kettle.hub import resolve_model

    model_path = str(resolve_model(args.model_id).path)
    prompts = chat_prompts(model_path)
    server = KettleServer(model_path, "--max-concurrent-requests", "256")
    try:
        results = {}
        asyncio.run(run_load(server.url, prompts, 2, 8))  # warm the server's first-call paths
        for c in (int(x) for x in args.streams.split(",")):
            results[c] = asyncio.run(run_load(server.url, prompts, c, args.max_new_tokens))
    finally:
        server.stop()
    rates = transformers_rates(model_path, prompts[: args.baseline_prompts], args.max_new_tokens)
    baseline = statistics.median(rates)
    single = results[min(results)].decode_tokens_per_s
    print(f"\nmodel: {model_path}\nmax_new_tokens={args.max_new_tokens}, greedy\n")
    print("| engine | streams | tok/s (aggregate) | decode tok/s | TTFT p50 s | ITL p50 ms | vs transformers b=1 |")
    print("|---|---|---|---|---|---|---|")
    print(f"| transformers generate | 1 | {baseline:.1f} | {baseline:.1f} | - | - | 1.00x |")
    for c, result in results.items():
        s = result.summary()
        print(
            f"| kettle | {c} | {s['tok/s']:.1f} | {s['decode tok/s']:.1f} | {s['ttft p50']:.3f} | "
            f"{s['itl p50'] * 1000:.1f} | {s['decode tok/s'] / baseline:.2f}x |"
        )
    largest = results[max(results)].decode_tokens_per_s
    print(f"\nsingle stream vs transformers: {single / baseline:.2f}x (bar 1.0x)")
    print(f"{max(results)} streams vs kettle single stream: {largest / single:.2f}x (bar 6x)")


if __name__ == "__main__":
    main()
