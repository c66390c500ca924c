"""How far Kettle's int8 serving of 5- and 8-bit GGUF types is from the file's own dequantization.

Q8_0, Q5_0 and Q5_1 have no Kettle kernel of their own: by default their weights are dequantized (gguf's
dequantize) and requantized to int8 with one scale per output channel. This rewrites every 2-D tensor of the
bundled SmolLM2 GGUF in one of those types (gguf.quants, from the bundled file's own values), then compares the
next-token distributions of Kettle's default path with Kettle running the file's dequantized weights densely
(which matches transformers within 1e-4 in the tests), over the prompt tokens of a few texts: mean and max KL.

    PYTHONPATH=. .venv/bin/python bench/gguf_nearest_kl.py [Q8_0 Q5_0 Q5_1]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from kettle.hub import resolve_model
from kettle.hub.gguf_header import read_header
from kettle.models.registry import load_model
from tests.models.drive import new_cache, scattered_tables, step

TEXTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Photosynthesis is the process by which green plants use sunlight to",
]


def requantized(folder: Path, out: Path, qtype: T) -> Path:
    """The bundled model with every 2-D tensor rewritten as `qtype` (norms stay F32)."""
    source = folder / "model.gguf"
    fields = read_header(source).fields
    reader = gguf.GGUFReader(source)
    out.mkdir(parents=True)
    writer = gguf.GGUFWriter(out / "model.gguf", "llama")
    for key in ("block_count", "attention.head_count", "attention.head_count_kv"):
        writer.add_uint32(f"llama.{key}", fields[f"llama.{key}"])
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if values.ndim == 2:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, out / name)
    return out


def logits(model, prompts: list[list[int]]) -> torch.Tensor:
    tables, blocks = scattered_tables([len(p) for p in prompts])
    return step(model, new_cache(model, blocks), prompts, [0] * len(prompts), tables)[0]


def main(types: list[str]) -> None:
    from transformers import AutoTokenizer

    folder = resolve_model().path
    prompts = [AutoTokenizer.from_pretrained(folder)(text).input_ids for text in TEXTS]
    for name in types:
        with tempfile.TemporaryDirectory() as temp:
            path = str(requantized(folder, Path(temp) / name, T[name]))
            reference = logits(load_model(path, torch.float32, "cpu", dequantize=True), prompts)
            served = logits(load_model(path, torch.float32, "cpu"), prompts)
        kl = (reference.softmax(-1) * (reference.log_softmax(-1) - served.log_softmax(-1))).sum(-1)
        top1 = (reference.argmax(-1) == served.argmax(-1)).float().mean()
        print(f"{name}: mean KL {kl.mean():.2e}, max KL {kl.max():.2e}, top-1 agreement {top1:.3f}, {len(kl)} tokens")


if __name__ == "__main__":
    main(sys.argv[1:] or ["Q8_0", "Q5_0", "Q5_1"])
