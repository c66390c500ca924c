"""What serving LoRA adapters costs: 16 streams spread over 4 adapters against 16 streams on the base model.

    .venv/bin/python bench/lora_throughput.py                      # bundled model, rank 16, 16 streams, 3 rounds
    .venv/bin/python bench/lora_throughput.py --quantize int4 --rounds 5

One server (the bundled model, or --model-id) with 4 generated rank-R adapters on every projection
(q, k, v, o, gate, up, down). Each round runs the base-model batch and the adapters batch back to back (the order
alternates), so both see the same machine; the table gives each round's aggregate generated tok/s and the
median ratio. The adapters are random (B ~ N(0, 0.02)): their outputs are noise, their cost is real.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from kettle.bench.process import KettleServer
from kettle.hub.resolve import resolve_model

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA checkpoint for `config`'s shapes, on every projection of every layer."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv, inner = (
        config["num_attention_heads"] * head_dim,
        config["num_key_value_heads"] * head_dim,
        config["intermediate_size"],
    )
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    shapes |= {"gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for block, names in MODULES.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    targets = [n for names in MODULES.values() for n in names]
    peft = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(peft))
    return folder


async def batch_tok_s(url: str, adapters: list[str | None], max_new_tokens: int) -> float:
    """Aggregate generated tokens per second of one request per entry of `adapters`, all sent at once. A request
    that stops early (EOS) would leave a smaller batch behind and flatter the rate, so every request must run to
    `max_new_tokens`: the prompt asks for a long story, and a run where one stops early is reported as such."""

    async def one(client: httpx.AsyncClient, adapter: str | None) -> int:
        parameters = {"max_new_tokens": max_new_tokens, "details": True}
        if adapter:
            parameters["adapter_id"] = adapter
        response = await client.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": parameters})
        response.raise_for_status()
        return response.json()["details"]["generated_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, a) for a in adapters))
    if min(tokens) < max_new_tokens:
        raise SystemExit(f"a request stopped after {min(tokens)} tokens: the rates would not compare batches alike")
    return sum(tokens) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = resolve_model(args.model_id).path
    config = json.loads((folder / "config.json").read_text())
    root = Path(tempfile.mkdtemp(prefix="kettle-lora-bench-"))
    names = [f"a{i}" for i in range(4)]
    value = ",".join(f"{n}={write_adapter(root / n, config, args.rank, i)}" for i, n in enumerate(names))
    flags = ["--lora-adapters", value, *(["--quantize", args.quantize] if args.quantize else [])]
    server = KettleServer(args.model_id, *flags)
    try:
        base_batch = [None] * args.streams
        lora_batch = [names[i % len(names)] for i in range(args.streams)]
        asyncio.run(batch_tok_s(server.url, lora_batch[:4], 8))  # warm every adapter's path once
        rows = []
        for round_ in range(args.rounds):
            order = [("base", base_batch), ("lora", lora_batch)]
            measured = {}
            for label, batch in order if round_ % 2 == 0 else order[::-1]:
                measured[label] = asyncio.run(batch_tok_s(server.url, batch, args.max_new_tokens))
            rows.append((measured["base"], measured["lora"]))
    finally:
        server.stop()
    print(f"{args.streams} streams, {args.max_new_tokens} new tokens, rank {args.rank}, quantize {args.quantize}")
    print("| round | base tok/s | 4 adapters tok/s | adapters / base |\n|---|---|---|---|")
    for i, (base, lora) in enumerate(rows):
        print(f"| {i + 1} | {base:.1f} | {lora:.1f} | {lora / base:.2f} |")
    print(f"median ratio: {statistics.median(lora / base for base, lora in rows):.2f}")


if __name__ == "__main__":
    main()
