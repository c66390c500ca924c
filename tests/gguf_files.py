"""Tiny GGUF files written at test time with `gguf.GGUFWriter` from random transformers models.

Each projection (and the embedding) is quantized with `gguf.quants` (Q4_K and Q6_K, which gguf-py cannot
quantize, get random well-formed blocks), norms stay F32. The file is laid out as llama.cpp's converter writes it,
quirks included (`to_gguf`): llama's q/k rows permuted, Gemma 2's and 3's norms stored as 1 + w, GPT-2's Conv1D weights
transposed, Falcon's and BLOOM's fused q/k/v rows regrouped into [q | k | v]; `from_gguf` undoes them, as
transformers' GGUF loader does. The metadata carries what that loader reads back into a config.
The folder holds the transformers config.json and the file as `model.gguf`, the layout Kettle prepares.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

ARCHES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "falcon": "FalconForCausalLM",
    "bloom": "BloomForCausalLM",
}
CONFIGS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "phi3": "Phi3Config",
    "gemma2": "Gemma2Config",
    "gemma3": "Gemma3TextConfig",
    "starcoder2": "Starcoder2Config",
    "gpt2": "GPT2Config",
    "falcon": "FalconConfig",
    "bloom": "BloomConfig",
}
VOCAB = 96
# Architectures whose tiny config is written from the GGUF's metadata by transformers, as `prepare_gguf` does.
FROM_METADATA = ("phi3", "gemma2", "gemma3", "starcoder2", "gpt2", "falcon", "bloom")
# Gemma 3: six layers, llama.cpp's pattern (the sixth global), a window shorter than the prompts, the global RoPE
# base and its linear scaling off the local table's (transformers' defaults are the published models').
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}


def _config_kwargs(arch: str, hidden: int) -> dict:
    """Tiny settings in each config class's own names. Values the GGUF metadata cannot carry (and
    transformers' reader leaves at its defaults) stay at the defaults here too."""
    heads = {"num_attention_heads": 4, "num_hidden_layers": 2}
    llama_like = heads | {
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }  # fmt: skip
    tied = {"tie_word_embeddings": True}
    kwargs = {
        "llama": llama_like | {"head_dim": hidden // 4},
        "qwen2": llama_like | {"head_dim": hidden // 4},
        "qwen3": llama_like | {"head_dim": hidden // 4},
        # Sliding windows shorter than the prompts; RoPE bases and soft caps off their defaults: the config
        # must come from the file's metadata.
        "phi3": llama_like | {"pad_token_id": 0, "sliding_window": 5},
        "gemma2": llama_like
        | tied
        | {"head_dim": hidden // 4, "query_pre_attn_scalar": hidden // 4, "sliding_window": 4, "pad_token_id": 0}
        | {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0},
        "gemma3": llama_like
        | tied
        | {"head_dim": hidden // 4, "query_pre_attn_scalar": hidden // 4, "sliding_window": 4, "pad_token_id": 0}
        | {"num_hidden_layers": 6, "rope_parameters": GEMMA3_ROPE},
        "starcoder2": llama_like | tied | {"norm_epsilon": 1e-5, "rope_theta": 1e5},
        "gpt2": tied | {"n_embd": hidden, "n_layer": 2, "n_head": 4, "n_positions": 1024},
        "falcon": heads | tied | {"hidden_size": hidden},
        "bloom": {"hidden_size": hidden, "n_layer": 2, "n_head": 4},
    }[arch]
    return kwargs | {"vocab_size": VOCAB, "initializer_range": 0.2}


def tiny_model(arch: str, hidden: int, seed: int = 0, **overrides):
    import transformers

    config = getattr(transformers, CONFIGS[arch])(**_config_kwargs(arch, hidden) | overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHES[arch])(config).eval()
    if arch in FROM_METADATA:
        # Random norms and biases (they initialise to 1 and 0), so a wrong offset or a lost bias shows.
        with torch.no_grad():
            for tensor in model.parameters():
                if tensor.ndim == 1:
                    tensor.copy_(tensor + 0.1 * torch.randn_like(tensor))
    return model


def llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter `permute`: Hugging Face's rotate-half rows → interleaved pairs."""
    pairs = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def _heads(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    if config.model_type == "falcon":
        return heads, (config.num_kv_heads if config.new_decoder_architecture else 1)
    return heads, getattr(config, "num_key_value_heads", heads)


def to_gguf(arch: str, name: str, data: np.ndarray, config) -> np.ndarray:
    """What llama.cpp's converter does to a Hugging Face tensor before writing it."""
    heads, kv_heads = _heads(config)
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        return llama_permute(data, heads if "q_proj" in name else kv_heads)
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return data + 1  # Gemma's RMSNorm scales by 1 + w: llama.cpp stores the sum (Gemma 3's q/k norms too)
    if arch == "gpt2" and data.ndim == 2 and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
        return np.ascontiguousarray(data.T)  # Conv1D [in, out] → [out, in]
    if arch == "falcon" and "query_key_value" in name:
        # [kv groups, G queries + k + v, head_dim, in] → [q heads | k heads | v heads]
        qkv = data.reshape(kv_heads, heads // kv_heads + 2, -1, *data.shape[1:])
        parts = [qkv[:, :-2], qkv[:, -2:-1], qkv[:, -1:]]
        return np.concatenate([p.reshape(-1, *data.shape[1:]) for p in parts])
    if arch == "bloom" and "query_key_value" in name:
        # [heads, 3, head_dim, in] → [q heads | k heads | v heads]
        qkv = data.reshape(heads, 3, -1, *data.shape[1:])
        return np.ascontiguousarray(qkv.swapaxes(0, 1)).reshape(data.shape)
    return data


def from_gguf(arch: str, name: str, data: np.ndarray, config) -> np.ndarray:
    """`to_gguf` undone (transformers' GGUF loader does the same), giving the Hugging Face tensor."""
    heads, kv_heads = _heads(config)
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        n = heads if "q_proj" in name else kv_heads
        return data.reshape(n, data.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(data.shape)
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return data - 1
    if arch == "gpt2" and data.ndim == 2 and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
        return np.ascontiguousarray(data.T)
    if arch == "falcon" and "query_key_value" in name:
        head_dim, rest = data.shape[0] // (heads + 2 * kv_heads), data.shape[1:]
        q, k, v = np.split(data, [heads * head_dim, (heads + kv_heads) * head_dim])
        groups = [q.reshape(kv_heads, -1, head_dim, *rest), *(p.reshape(kv_heads, 1, head_dim, *rest) for p in (k, v))]
        return np.concatenate(groups, axis=1).reshape(data.shape)
    if arch == "bloom" and "query_key_value" in name:
        qkv = data.reshape(3, heads, -1, *data.shape[1:])
        return np.ascontiguousarray(qkv.swapaxes(0, 1)).reshape(data.shape)
    return data


def random_q4_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Well-formed Q4_K blocks: random nibbles and 6-bit scales, small float16 super-block scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.full((rows, cols // 256, 1), 1.5e-3, np.float16).view(np.uint8)
    blocks[..., 2:4] = np.full((rows, cols // 256, 1), 2e-3, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def random_q5_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Well-formed Q5_K blocks: random nibbles, fifth bits and 6-bit scales, small float16 super-block scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 176), dtype=np.uint8)
    blocks[..., 0:2] = np.full((rows, cols // 256, 1), 1e-3, np.float16).view(np.uint8)
    blocks[..., 2:4] = np.full((rows, cols // 256, 1), 2e-3, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def random_iq4_xs(rows: int, cols: int, seed: int) -> np.ndarray:
    """Well-formed IQ4_XS blocks: random grid indices and 6-bit scales, a small float16 d per super-block."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 136), dtype=np.uint8)
    blocks[..., 0:2] = np.full((rows, cols // 256, 1), 1e-4, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def random_q6_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Well-formed Q6_K blocks: random 6-bit values and int8 scales, a small float16 d of its own per super-block."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., 208:210] = (rng.random((rows, cols // 256, 1)) * 1e-5 + 2e-6).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def encode(weight: np.ndarray, qtype: T, seed: int) -> np.ndarray:
    from gguf import quants

    if qtype == T.Q4_K:
        return random_q4_k(*weight.shape, seed)
    if qtype == T.Q6_K:
        return random_q6_k(*weight.shape, seed)
    if qtype == T.Q5_K:
        return random_q5_k(*weight.shape, seed)
    if qtype == T.IQ4_XS:
        return random_iq4_xs(*weight.shape, seed)
    return quants.quantize(weight, qtype)


def _write_metadata(writer, arch: str, config) -> None:
    """The keys llama.cpp's converter writes for `arch` (those transformers' GGUF reader maps to a config)."""
    hidden = config.hidden_size
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(hidden)
    writer.add_head_count(config.num_attention_heads)
    if arch in ("gpt2", "falcon", "bloom"):
        # Falcon's converter writes 2048 (its configs have no length), BLOOM's the hidden size.
        writer.add_context_length(config.n_positions if arch == "gpt2" else 2048 if arch == "falcon" else hidden)
        writer.add_feed_forward_length(4 * hidden)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        if arch != "gpt2":
            writer.add_head_count_kv(_heads(config)[1])
    else:
        writer.add_context_length(config.max_position_embeddings)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count_kv(config.num_key_value_heads)
        if arch == "starcoder2":
            writer.add_layer_norm_eps(config.norm_epsilon)
        else:
            writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch in ("llama", "qwen2", "qwen3"):
        writer.add_rope_dimension_count(config.head_dim)
    if arch in ("starcoder2", "phi3"):
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if arch == "phi3":
        writer.add_sliding_window(config.sliding_window or 0)
        if (config.rope_parameters or {}).get("rope_type") == "longrope":
            writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
            for kind in ("long", "short"):
                factors = np.array(config.rope_parameters[f"{kind}_factor"], np.float32)
                writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if arch == "gemma2":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        gemma3_metadata(writer, config)
    # transformers takes the vocabulary size from the token list where the metadata has no vocab_size.
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    if getattr(config, "pad_token_id", None) is not None:
        writer.add_pad_token_id(config.pad_token_id)


def gemma3_metadata(writer, config) -> None:
    """Gemma3Model.set_gguf_parameters: the head size, the window, the global RoPE base and its linear scaling (the
    local base and the layer pattern are llama.cpp's own constants, not written)."""
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    full = config.rope_parameters["full_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def gguf_names(arch: str, layers: int):
    import gguf

    return gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)


def _gguf_name(names, name: str) -> str:
    # BLOOM's names are mapped without the "transformer." prefix (llama.cpp's converter strips it).
    found = names.get_name(name, try_suffixes=(".weight", ".bias"))
    found = found or names.get_name(name.removeprefix("transformer."), try_suffixes=(".weight", ".bias"))
    if found is None:
        raise KeyError(f"{name} has no GGUF name")
    return found


def write_gguf(
    model, path: Path, arch: str, qtype: T, embedding: T | None = None, types: dict[str, T] | None = None
) -> Path:
    """Writes `model`'s tensors into `path` / model.gguf and its config.json; returns the folder. `types`: a GGUF
    tensor name's own type where it is not `qtype` (as llama.cpp's mixes write some layers' tensors)."""
    import gguf

    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    writer = gguf.GGUFWriter(path / "model.gguf", arch)
    _write_metadata(writer, arch, config)
    names = gguf_names(arch, config.num_hidden_layers)
    for seed, (name, tensor) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head is the embedding (llama.cpp writes no copy)
        data = to_gguf(arch, name, tensor.float().numpy(), config)
        is_embedding = name.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight"))
        wanted = embedding if is_embedding and embedding is not None else qtype  # T.F32 is 0: falsy
        gguf_name = _gguf_name(names, name)
        wanted = (types or {}).get(gguf_name, wanted)
        if data.ndim == 2 and wanted != T.F32 and "wpe" not in name:
            writer.add_tensor(gguf_name, encode(data, wanted, seed), raw_dtype=wanted)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if arch in FROM_METADATA:
        from kettle.hub.gguf import save_config

        save_config(path / "model.gguf", path)
    else:
        config.save_pretrained(path)
    return path


def dequantized_reference(model, folder: Path, arch: str):
    """`model` with every weight replaced by gguf's own dequantization of the file (converter transforms undone)."""
    from gguf import GGUFReader, quants

    reader = GGUFReader(folder / "model.gguf")
    config = model.config
    names = gguf_names(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    state = {}
    for name, original in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        tensor = tensors[_gguf_name(names, name)]
        values = quants.dequantize(tensor.data, tensor.tensor_type)
        values = from_gguf(arch, name, values.reshape(-1, *values.shape[-1:]) if values.ndim > 1 else values, config)
        state[name] = torch.from_numpy(np.array(values, np.float32)).reshape(original.shape)
    model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model
