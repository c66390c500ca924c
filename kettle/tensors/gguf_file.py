"""A GGUF file's tensors under their Hugging Face names, read from the memory-mapped file.

The header is read once (kettle/hub/gguf_header.py) and the file memory-mapped; each tensor's raw blocks are a
view of the map, so nothing is read until a loader asks for a tensor. Names are translated with gguf's own
`TensorNameMap` (the table llama.cpp's converter wrote them with), so `model.layers.0.self_attn.q_proj.weight`
finds `blk.0.attn_q.weight`.

The converter also changes some tensors on the way; reading them back undoes what the families expect undone:
- Llama's q and k rows are permuted (its RoPE pairs neighbouring channels, Hugging Face's pairs halves): the
  permutation is undone on whole rows, which is exact for quantized rows too (their blocks run along the input
  channels), so they stay quantized;
- Gemma 2's and Gemma 3's RMSNorm weights (every name ending in `norm.weight`: Gemma 3's per-head q and k norms
  too) are stored as 1 + w (what llama.cpp multiplies by): 1 is taken off again, since the Gemma families add it
  themselves;
- Falcon's query_key_value with several KV heads (40B, 180B, 11B), grouped per KV head in Hugging Face's
  layout, is regrouped into [q heads | k heads | v heads]: its rows are moved back (for the 7B's single KV
  head both layouts are the same);
- BLOOM's names lose their "transformer." prefix: both spellings find the tensor.
Two tensors are left as the converter wrote them, because it wrote them in Kettle's own layout and their
loaders read them as such from a GGUF (`Weights.gguf`), keeping them quantized: GPT-2's Conv1D weights,
transposed to [out, in], and BLOOM's fused query_key_value, regrouped from per-head [q, k, v] triples into
[q heads | k heads | v heads] (weight and bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from kettle.hub.gguf import GGUF_LINK
from kettle.hub.gguf_header import TensorInfo, read_header

# Architectures whose q/k rows llama.cpp's converter permuted (transformers' LlamaTensorProcessor undoes the same).
PERMUTED_QK = ("llama",)
# Architectures whose RMSNorm weights the converter stored as 1 + w (transformers' Gemma2TensorProcessor).
NORMS_PLUS_ONE = ("gemma2", "gemma3")
# Architectures whose converter strips this prefix from every name before mapping it.
STRIPPED_PREFIX = {"bloom": "transformer."}
# What Kettle serves: dense floats, 4-bit types on the int4 kernel exactly, the 5-8-bit types in layouts of their own
# where the kernels have them (kettle/quantization/gguf_scheme.py), else requantized to the nearest scheme.
EXACT_INT4 = (T.Q4_0, T.Q4_1, T.Q4_K)
NEAREST_INT8 = (T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.IQ4_XS)
DENSE = (T.F32, T.F16, T.BF16)
SUPPORTED = DENSE + EXACT_INT4 + NEAREST_INT8


def check_supported(qtype: T, name: str) -> None:
    """One line naming the types that work, for a tensor stored in any other type."""
    if qtype not in SUPPORTED:
        names = ", ".join(t.name for t in SUPPORTED)
        raise ValueError(f"GGUF tensor {name!r} is stored as {qtype.name}, which Kettle cannot serve ({names} work)")


@dataclass(frozen=True)
class Blocks:
    """A 2-D tensor's raw quantized blocks as the file stores them (uint8 [rows, bytes a row], memory-mapped),
    its type, its [rows, cols] shape and the row order that gives Hugging Face's rows (None: as stored)."""

    data: np.ndarray
    qtype: T
    rows: int
    cols: int
    order: torch.Tensor | None


def raw_rows(mapped: np.ndarray, tensor: TensorInfo) -> np.ndarray:
    """A tensor's bytes as uint8 [rows, bytes a row], a view of the file's map (gguf's dequantize takes this)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[T(tensor.qtype)]
    row_bytes = tensor.dims[0] // block * size
    rows = int(np.prod(tensor.dims[1:], dtype=np.int64))
    return mapped[tensor.offset : tensor.offset + rows * row_bytes].reshape(rows, row_bytes)


def folder_gguf(folder: Path) -> Path | None:
    """The GGUF file a prepared model folder reads its weights from, if it is one."""
    link = folder / GGUF_LINK
    return link if link.exists() else None


class GgufTensors:
    """Tensors of one GGUF file by Hugging Face name: shapes, dense float32 values, and int4 groups."""

    def __init__(self, path: Path) -> None:
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        self.path = path
        header = read_header(path)
        self.map = np.memmap(path, dtype=np.uint8, mode="r")
        fields = header.fields
        self.architecture = fields["general.architecture"]
        arch = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}[self.architecture]
        self.block_count = int(fields[f"{self.architecture}.block_count"])
        self._names = get_tensor_name_map(arch, self.block_count)
        self._tensors = {tensor.name: tensor for tensor in header.tensors}
        self._heads = (fields.get(f"{self.architecture}.attention.head_count"),
                       fields.get(f"{self.architecture}.attention.head_count_kv"))  # fmt: skip

    @property
    def qtypes(self) -> list[T]:
        """The type of every 2-D tensor (what the default scheme is chosen from)."""
        return [T(tensor.qtype) for tensor in self._tensors.values() if len(tensor.dims) == 2]

    def gguf_name(self, name: str) -> str | None:
        """`name`'s tensor in the file (None when absent)."""
        mapped = self._names.get_name(name, try_suffixes=(".weight", ".bias"))
        prefix = STRIPPED_PREFIX.get(self.architecture)
        if mapped is None and prefix and name.startswith(prefix):
            mapped = self._names.get_name(name.removeprefix(prefix), try_suffixes=(".weight", ".bias"))
        return mapped if mapped in self._tensors else None

    def has(self, name: str) -> bool:
        return self.gguf_name(name) is not None

    @property
    def names(self) -> list[str]:
        return sorted(self._tensors)

    def _tensor(self, name: str) -> TensorInfo:
        gguf_name = self.gguf_name(name)
        if gguf_name is None:
            raise KeyError(f"tensor {name!r} is not in {self.path}")
        tensor = self._tensors[gguf_name]
        check_supported(T(tensor.qtype), gguf_name)
        return tensor

    def _raw(self, tensor: TensorInfo) -> np.ndarray:
        return raw_rows(self.map, tensor)

    def shape(self, name: str) -> list[int]:
        """[out, in] (GGUF lists dimensions innermost first)."""
        return [int(d) for d in reversed(self._tensor(name).dims)]

    def qtype(self, name: str) -> T:
        return T(self._tensor(name).qtype)

    def dense(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32 by gguf's own dequantization, rows in Hugging Face order."""
        from gguf.quants import dequantize

        tensor = self._tensor(name)
        # A copy, also for F32: a tensor over the read-only map would crash anything that writes in place.
        values = torch.from_numpy(np.array(dequantize(self._raw(tensor), T(tensor.qtype)), np.float32))
        values = values.reshape(self.shape(name))
        if self.architecture in NORMS_PLUS_ONE and name.endswith("norm.weight"):
            # The family adds the 1 back: 1 + (s - 1) gives the stored s exactly for s >= 0.5, within an ulp below.
            values -= 1.0
        order = self._row_order(name, values.shape[0])
        return values if order is None else values[order]

    def blocks(self, name: str) -> Blocks:
        """The raw blocks of a 2-D tensor, for the quantized layers to decode into their own layout."""
        tensor = self._tensor(name)
        rows, cols = self.shape(name)
        return Blocks(self._raw(tensor), T(tensor.qtype), rows, cols, self._row_order(name, rows))

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """The row order that undoes llama.cpp's q/k permutation or Falcon's q/k/v regrouping, or None when the
        rows are as stored."""
        heads, kv_heads = self._heads
        if self.architecture == "falcon" and kv_heads and kv_heads > 1 and "query_key_value." in name:
            return falcon_grouped_order(heads, kv_heads, rows)
        if self.architecture not in PERMUTED_QK or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        heads = heads if name.endswith("q_proj.weight") else kv_heads
        half = rows // heads // 2
        # Stored row (h, i, j) for i < half, j < 2 holds Hugging Face row (h, j, i).
        return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def falcon_grouped_order(heads: int, kv_heads: int, rows: int) -> torch.Tensor:
    """Rows taking llama.cpp's [q heads | k heads | v heads] back to Falcon's grouped layout (40B, 180B, 11B):
    per KV head, its group of query heads, then its k, then its v."""
    head_dim = rows // (heads + 2 * kv_heads)
    stored = torch.arange(rows)
    q = stored[: heads * head_dim].view(kv_heads, heads // kv_heads, head_dim)
    k, v = stored[heads * head_dim :].view(2, kv_heads, 1, head_dim)
    return torch.cat([q, k, v], dim=1).reshape(rows)
