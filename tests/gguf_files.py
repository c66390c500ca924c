"""Tiny GGUF files written at test time with `gguf.GGUFWriter` from random transformers models.

Each projection (and the embedding) is quantized with `gguf.quants` (Q4_K, which gguf-py cannot quantize, gets
random well-formed blocks), norms stay F32; llama's q/k rows are permuted as llama.cpp's converter does.
The folder holds the transformers config.json and the file as `model.gguf`, the layout Kettle prepares.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

ARCHES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def tiny_model(arch: str, hidden: int, seed: int = 0):
    import transformers

    config_cls = getattr(transformers, ARCHES[arch].replace("ForCausalLM", "Config"))
    config = config_cls(
        vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(seed)
    return getattr(transformers, ARCHES[arch])(config).eval()


def llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter `permute`: Hugging Face's rotate-half rows → interleaved pairs."""
    pairs = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def random_q4_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Well-formed Q4_K blocks: random nibbles and 6-bit scales, small float16 super-block scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.full((rows, cols // 256, 1), 1.5e-3, np.float16).view(np.uint8)
    blocks[..., 2:4] = np.full((rows, cols // 256, 1), 2e-3, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def encode(weight: np.ndarray, qtype: T, seed: int) -> np.ndarray:
    from gguf import quants

    if qtype == T.Q4_K:
        return random_q4_k(*weight.shape, seed)
    return quants.quantize(weight, qtype)


def write_gguf(model, path: Path, arch: str, qtype: T, embedding: T | None = None) -> Path:
    """Writes `model`'s tensors into `path` / model.gguf and its config.json; returns the folder."""
    import gguf

    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    writer = gguf.GGUFWriter(path / "model.gguf", arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_hidden_layers)
    for seed, (name, tensor) in enumerate(model.state_dict().items()):
        data = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = llama_permute(data, heads)
        wanted = (embedding or qtype) if "embed_tokens" in name else qtype
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if data.ndim == 2 and wanted != T.F32:
            writer.add_tensor(gguf_name, encode(data, wanted, seed), raw_dtype=wanted)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config.save_pretrained(path)
    return path


def dequantized_reference(model, folder: Path, arch: str):
    """`model` with every weight replaced by gguf's own dequantization of the file (q/k rows un-permuted)."""
    import gguf
    from gguf import GGUFReader, quants

    reader = GGUFReader(folder / "model.gguf")
    config = model.config
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    state = {}
    for name in model.state_dict():
        tensor = tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))]
        values = quants.dequantize(tensor.data, tensor.tensor_type).reshape(model.state_dict()[name].shape)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # transformers' reverse_permute
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            values = values.reshape(heads, values.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)
        state[name] = torch.from_numpy(np.array(values, np.float32))
    model.load_state_dict(state)
    return model
