"""GGUF → safetensors folder: the one-time conversion behind the bundled model and any `.gguf` a user passes.

transformers (with the `gguf` package) reads the file's metadata, tokenizer, chat template and weights and
dequantizes them; we save the result as an ordinary Hugging Face folder so the shards, the router and the
parity tests all load one format. Everything torch or transformers is imported inside the functions, so
importing this module is free.
"""

from __future__ import annotations

import json
from pathlib import Path

# Below this, `model_max_length` is a real limit; at or above it, transformers' "no limit known" sentinel.
_UNLIMITED = 10**18


def convert_gguf(gguf_path: Path, out_dir: Path, trust_remote_code: bool = False) -> None:
    """Writes config.json, generation_config.json, model.safetensors and the tokenizer files into `out_dir`."""
    model = _save_model(gguf_path, out_dir, trust_remote_code)
    _save_tokenizer(gguf_path, out_dir, trust_remote_code, context_length=_context_length(model.config))
    _add_legacy_config_keys(out_dir / "config.json")


def _save_model(gguf_path: Path, out_dir: Path, trust_remote_code: bool):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    # The weights are already dequantized to float32, but transformers still marks the model as "quantized
    # with gguf" and refuses to save it; what we write is a plain float checkpoint, so drop the marks.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    return model


def _save_tokenizer(gguf_path: Path, out_dir: Path, trust_remote_code: bool, context_length: int | None) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, trust_remote_code=trust_remote_code
    )
    # GGUF carries no tokenizer length limit; without one the router could not derive --max-input-tokens.
    if context_length and tokenizer.model_max_length >= _UNLIMITED:
        tokenizer.model_max_length = context_length
    tokenizer.save_pretrained(out_dir)
    _embed_chat_template(out_dir / "tokenizer_config.json", tokenizer.chat_template)


def _embed_chat_template(tokenizer_config: Path, template: str | dict | None) -> None:
    """Also keeps the chat template inside tokenizer_config.json, where TGI-era readers look for it.

    Recent transformers writes it only to chat_template.jinja; the copy here costs nothing and makes the
    folder readable by every client, whichever of these places it looks in first.
    """
    if not template or not tokenizer_config.exists():
        return
    settings = json.loads(tokenizer_config.read_text())
    settings.setdefault("chat_template", template)
    tokenizer_config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def _context_length(config) -> int | None:
    return getattr(config, "max_position_embeddings", None)


def _add_legacy_config_keys(config_path: Path) -> None:
    """Mirrors `rope_parameters.rope_theta` as a top-level `rope_theta`, the key older configs use.

    transformers 5 nests it; model code written against published checkpoints reads the top-level key.
    """
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
