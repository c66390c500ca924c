"""GGUF architectures transformers reads under another name: llama.cpp writes Qwen2-VL's and Qwen2.5-VL's language
model as `qwen2vl` (Qwen2 with M-RoPE sections), which transformers' GGUF reader does not list, though its
metadata is Qwen2's key for key. Inside `read_as_alias` the reader sees such a file as the architecture it is
an alias of, so the config and tokenizer come from transformers' own reading; what it leaves out (the rotary
sections) the projector's preparation reads itself (kettle/hub/mmproj_config.py). Kettle's own reader keeps the
file's name: its tensor names are the alias's (gguf's `MODEL_ARCH.QWEN2VL` map).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

ALIASES = {"qwen2vl": "qwen2"}


@contextmanager
def read_as_alias() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader` (what transformers' GGUF loader reads with) presents an aliased file's
    architecture, and its keys, under the alias's name."""
    import gguf
    import numpy as np
    from gguf.gguf_reader import ReaderField

    original = gguf.GGUFReader

    class AliasReader(original):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            field = self.fields.get("general.architecture")
            name = bytes(field.parts[field.data[0]]).decode() if field is not None else None
            if name not in ALIASES:
                return
            alias = ALIASES[name]
            parts = list(field.parts)
            parts[field.data[0]] = np.frombuffer(alias.encode(), dtype=np.uint8)
            renamed = {"general.architecture": ReaderField(field.offset, field.name, parts, field.data, field.types)}
            for key, value in self.fields.items():
                if key.startswith(f"{name}."):
                    renamed[alias + key[len(name) :]] = value
            self.fields = {**{k: v for k, v in self.fields.items() if not k.startswith(f"{name}.")}, **renamed}

    gguf.GGUFReader = AliasReader
    try:
        yield
    finally:
        gguf.GGUFReader = original
