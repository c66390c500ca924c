"""Kettle against llama.cpp on a model the size people run: a random-weight GGUF of a real model's shape.

The bundled SmolLM2-135M is small enough that fixed costs per token decide its comparisons (llama.cpp prefills
it at ~230 tok/s but a model eight times larger at ~100). This bench writes a GGUF of a larger shape with random
weights (models cannot be downloaded here; speed does not depend on the values) and times, interleaved round by
round so both see the same machine load:

- decode: llama.cpp (llama-cpp-python, greedy `generate` after a 16-token prompt) against Kettle's bare decode
  step as the shard runs it (metadata, the model's forward, the LM head of the last token, argmax), no server;
- prefill: a `--prompt`-token prompt, nothing cached, through each.

Each round prints both engines' figures; the summary gives medians, the same-round ratios' median, and the GB/s a
decode step implies from the weight bytes each engine reads (Kettle's tensors; llama.cpp's file).

    .venv/bin/python bench/larger_gguf.py                                  # TinyLlama-1.1B's shape, Q4_0
    .venv/bin/python bench/larger_gguf.py --shape llama-3.2-1b --qtype Q4_K --rounds 5

The file goes to ~/.cache/kettle/bench/<shape>-<qtype>/ (written once, ~0.6-1 GB; a minute) with a config.json
and the bundled model's tokenizer, which every shape here uses (vocabulary 49,152), so Kettle loads the folder
as it loads any GGUF folder. Q4_K blocks are random but well formed (gguf-py cannot quantize to Q4_K); the
embedding, tied to the head, is Q8_0 as in llama.cpp's own Q4 files of small models. `--untied` writes the
embedding in the layers' type and a head of its own in Q8_0, as a TinyLlama file is laid out (its Q4_K_M head is
Q6_K, which gguf-py cannot write):

    .venv/bin/python bench/larger_gguf.py --untied --qtype Q4_K

`--qtype Q4_K_M` lays the file out as llama.cpp's Q4_K_M does (untied): Q4_K layers and embedding, Q6_K for the
head and for `attn_v` and `ffn_down` in the layers its rule gives more bits (the first and last eighth, and every
third between), all random well-formed blocks. Kettle serves Q6_K on its own kernel where weights sit in lanes
(AVX-512 VNNI), but a fused q/k/v whose v is Q6_K and q, k Q4_K loads as int8 per channel.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kettle.hub import resolve_model
from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import load_model
from kettle.shard.dtype import choose_kv_dtype
from kettle.tensors.kv_cache import BLOCK_SIZE, KVCache

# hidden, layers, heads, KV heads, intermediate (the vocabulary is the bundled tokenizer's)
SHAPES = {
    "tinyllama-1.1b": (2048, 22, 32, 4, 5632),
    "llama-3.2-1b": (2048, 16, 32, 8, 8192),
    "smollm2-360m": (960, 32, 15, 5, 2560),
}
CACHE = Path.home() / ".cache" / "kettle" / "bench"
SETTLE_S = 1.0


def write_model(shape: str, qtype_name: str, untied: bool = False) -> Path:
    """The GGUF and its Kettle folder for `shape` in `qtype_name` (written once); `untied`: an embedding in the
    layers' type and a head of its own."""
    import gguf
    from gguf import GGMLQuantizationType as T

    untied = untied or qtype_name == "Q4_K_M"
    folder = CACHE / f"{shape}-{qtype_name}{'-untied' if untied and qtype_name != 'Q4_K_M' else ''}"
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    hidden, layers, heads, kv_heads, inner = SHAPES[shape]
    source = resolve_model(None).path
    writer = gguf.GGUFWriter(folder / "model.gguf", "llama")
    _metadata(writer, gguf.GGUFReader(source / "model.gguf"), SHAPES[shape], qtype_name)
    rng, qtype = np.random.default_rng(0), T[qtype_name.removesuffix("_M")]
    head_type = T.Q6_K if qtype_name == "Q4_K_M" else T.Q8_0  # llama.cpp's Q4_K_M head; gguf-py writes Q8_0
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    embedding = rng.standard_normal((vocab, hidden), dtype=np.float32) * 0.02
    if untied:
        writer.add_tensor("token_embd.weight", _random_blocks(rng, vocab, hidden, qtype), raw_dtype=qtype)
        if head_type == T.Q6_K:
            writer.add_tensor("output.weight", _random_blocks(rng, vocab, hidden, T.Q6_K), raw_dtype=T.Q6_K)
        else:
            writer.add_tensor("output.weight", gguf.quants.quantize(embedding, T.Q8_0), raw_dtype=T.Q8_0)
    else:
        writer.add_tensor("token_embd.weight", gguf.quants.quantize(embedding, T.Q8_0), raw_dtype=T.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    kv = kv_heads * (hidden // heads)
    projections = [("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                   ("attn_output", hidden, hidden), ("ffn_gate", inner, hidden), ("ffn_up", inner, hidden),
                   ("ffn_down", hidden, inner)]  # fmt: skip
    for layer in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, np.float32))
        for name, rows, cols in projections:
            more = qtype_name == "Q4_K_M" and name in ("attn_v", "ffn_down") and _more_bits(layer, layers)
            kind = T.Q6_K if more else qtype
            writer.add_tensor(f"blk.{layer}.{name}.weight", _random_blocks(rng, rows, cols, kind), raw_dtype=kind)
        print(f"wrote layer {layer + 1}/{layers}", file=sys.stderr, flush=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, head_dim=hidden // heads,
                  num_key_value_heads=kv_heads, intermediate_size=inner, max_position_embeddings=4096,
                  rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, rope_theta=10000.0,
                  tie_word_embeddings=not untied)  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _metadata(writer, source, shape: tuple[int, ...], qtype_name: str) -> None:
    """llama's keys for `shape`, and the bundled file's tokenizer keys copied as they are."""
    import gguf

    hidden, layers, heads, kv_heads, inner = shape
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_context_length(4096)
    writer.add_feed_forward_length(inner)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    types = {"Q4_0": "MOSTLY_Q4_0", "Q4_K": "MOSTLY_Q4_K_S", "Q4_K_M": "MOSTLY_Q4_K_M"}
    writer.add_file_type(gguf.LlamaFileType[types[qtype_name]])
    kinds = gguf.GGUFValueType
    for field in source.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == kinds.ARRAY:
            strings = field.types[-1] == kinds.STRING
            values = [bytes(field.parts[i]).decode() if strings else field.parts[i][0].item() for i in field.data]
            writer.add_array(field.name, values)
        elif kind == kinds.STRING:
            writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(field.name, field.parts[field.data[0]][0].item(), kind)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose attn_v and ffn_down Q4_K_M stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _random_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    import gguf
    from gguf import GGMLQuantizationType as T

    if qtype == T.Q4_K:  # well-formed blocks: random nibbles and 6-bit scales, small float16 super-block scales
        blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
        blocks[..., 0:2] = np.full((rows, cols // 256, 1), 1.5e-3, np.float16).view(np.uint8)
        blocks[..., 2:4] = np.full((rows, cols // 256, 1), 2e-3, np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)
    if qtype == T.Q6_K:  # 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, a float16 scale
        blocks = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
        blocks[..., 192:208] = rng.integers(1, 64, (rows, cols // 256, 16), dtype=np.uint8)
        blocks[..., 208:210] = np.full((rows, cols // 256, 1), 2e-4, np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32) * 0.02, qtype)


class KettleRunner:
    """The bundled path of a shard's step over a fresh paged cache (16-bit K/V, as a CPU shard keeps them)."""

    def __init__(self, folder: Path, prompt: int) -> None:
        self.model = load_model(str(folder), torch.float32, "cpu")
        spec = self.model.spec
        kv_dtype = choose_kv_dtype(None, spec.dtype, torch.device("cpu"))
        self.blocks = (prompt + 4096) // BLOCK_SIZE + 1
        shape = (spec.num_layers, self.blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
        self.cache = KVCache(*shape, kv_dtype, "cpu")

    @torch.inference_mode()
    def forward(self, ids: list[int], start: int) -> int:
        meta = AttentionMetadata.build([len(ids)], [start], [list(range(self.blocks))], BLOCK_SIZE, "cpu")
        hidden = self.model.forward(torch.tensor(ids), meta.positions, self.cache, meta)
        return int(self.model.compute_logits(hidden[meta.last_token_indices]).argmax(-1)[-1])

    def decode(self, tokens: int) -> float:
        """tok/s of `tokens` greedy steps after a 16-token prompt."""
        token, length = self.forward(list(range(100, 116)), 0), 16
        started = time.perf_counter()
        for _ in range(tokens):
            token, length = self.forward([token], length), length + 1
        return tokens / (time.perf_counter() - started)

    def prefill(self, prompt: int) -> float:
        started = time.perf_counter()
        self.forward(list(range(100, 100 + prompt)), 0)
        return prompt / (time.perf_counter() - started)

    def weight_bytes(self) -> int:
        """The bytes a decode step reads: every tensor but an embedding table of its own (a step looks up a few
        of its rows); a table tied to the head is read whole, as the head."""
        tensors = {t.data_ptr(): t for t in [*self.model.parameters(), *self.model.buffers()] if not t.is_mkldnn}
        table = getattr(self.model.embed_rows, "__self__", None)
        dense = getattr(self.model, "embed_tokens", None)
        own = [] if table is None or table is self.model.lm_head else [*table.buffers()]
        skip = {t.data_ptr() for t in own + ([dense] if isinstance(dense, torch.Tensor) else [])}
        return sum(t.numel() * t.element_size() for p, t in tensors.items() if p not in skip)


def file_step_bytes(path: Path) -> int:
    """The same for llama.cpp: the file's tensors, less an untied embedding table (a tied one is the head)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    return sum(tensors.values()) - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)


class LlamaCppRunner:
    def __init__(self, folder: Path, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(str(folder / "model.gguf"), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)  # fmt: skip

    def decode(self, tokens: int) -> float:
        stamps = []
        for _ in self.llm.generate(list(range(100, 116)), top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) > tokens:
                break
        return tokens / (stamps[-1] - stamps[0])

    def prefill(self, prompt: int) -> float:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(list(range(100, 100 + prompt)))
        return prompt / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--qtype", choices=["Q4_0", "Q4_K", "Q4_K_M"], default="Q4_0")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="decode steps timed per round")
    parser.add_argument("--prompt", type=int, default=512, help="prefill prompt length")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--untied", action="store_true", help="an embedding in --qtype and a Q8_0 head of its own")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = write_model(args.shape, args.qtype, args.untied)
    engines = {"kettle": KettleRunner(folder, args.prompt), "llama.cpp": LlamaCppRunner(folder, args.threads)}
    results = {name: {"decode": [], "prefill": []} for name in engines}
    for round_ in range(args.rounds):
        for name in list(engines) if round_ % 2 == 0 else list(engines)[::-1]:
            for kind, size in (("decode", args.tokens), ("prefill", args.prompt)):
                # One process holds both engines: the other one's idle threads (OpenMP's, llama.cpp's pool) spin
                # for a while after their last work, and would take a core from this measurement.
                time.sleep(SETTLE_S)
                results[name][kind].append(getattr(engines[name], kind)(size))
        line = (f"{n} decode {r['decode'][-1]:.1f}, prefill {r['prefill'][-1]:.1f} tok/s" for n, r in results.items())
        print(f"round {round_ + 1}: " + ", ".join(line), flush=True)
    sizes = {"kettle": engines["kettle"].weight_bytes(), "llama.cpp": file_step_bytes(folder / "model.gguf")}
    print(f"\n{args.shape} {args.qtype}, {args.threads} threads, medians of {args.rounds} rounds")
    print("| engine | decode tok/s | GB/s (weights a step) | prefill tok/s |\n|---|---|---|---|")
    for name, r in results.items():
        decode = statistics.median(r["decode"])
        print(f"| {name} | {decode:.1f} | {decode * sizes[name] / 1e9:.1f} ({sizes[name] / 2**20:.0f} MiB) "
              f"| {statistics.median(r['prefill']):.1f} |")  # fmt: skip
    for kind in ("decode", "prefill"):
        ratios = [a / b for a, b in zip(results["kettle"][kind], results["llama.cpp"][kind], strict=True)]
        print(f"Kettle / llama.cpp, {kind}: {statistics.median(ratios):.2f}x (rounds: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip


if __name__ == "__main__":
    main()
